"""The policy interface: everything the rollout and actor workers ask of a model
(docs/architecture.md). Workers import this module and the registry, nothing else of
``policies/``; each method has a default that fits a plain ``nn.Module`` trained whole.

Rollout calls ``act(obs)`` under no_grad and stores its ``forward_inputs`` and ``actions``;
training calls ``evaluate(forward_inputs, actions)`` (also reachable as ``policy(...)``, so
FSDP's forward hooks fire) to recompute log-probs with gradients. Log-probs and entropies come
per token, ``[B, num_action_chunks, action_dim]`` (a token is one action dim: a bin index for
discretized actions, one coordinate for Gaussian ones, one generated token of a text response);
the algorithms sum them to the level of ``algorithm.logprob_type``.

Variable-length actions: a text response is ``action_dim = max_new_tokens`` token ids padded
after EOS, and ``ActOutput.token_mask`` (``[B, C, action_dim]`` bool) marks the tokens that were
really generated. Fixed-size policies leave it ``None``: every token counts. Masked tokens carry
log-prob 0, and the actor leaves them out of every loss term.

Weights: the *trainable* state is what changes in training: every tensor when all parameters
train, else only the parameters that do (LoRA adapters, value head: the frozen base never changes).
It is what a weight sync carries (``trainable_state_dict`` on the actor,
``load_trainable_state_dict`` on a rollout copy). Checkpoints are the policy's own layout
(``save_checkpoint`` / ``read_checkpoint``): one ``model.pt`` by default; a policy with a published
folder layout (OpenVLA-OFT: peft adapters, head files; the causal LM with LoRA: the peft adapter)
overrides both.

A policy is built from plain options (the ``actor.model`` mapping); the config layer
(``embodied.config.build_policy``) checks them against the schema's rules first.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from core.description import EnvDescription
from core.errors import CheckpointError, ConfigError, expected
from policies.weights import check_keys, full_tensor, is_writer

MODEL_FILE = "model.pt"


@dataclass
class ActOutput:
    actions: Tensor  # [B, C, action_dim] what the env executes: float32, or int64 token ids for text
    logprobs: Tensor  # [B, C, action_dim] per-token log-probs of those actions
    values: Tensor | None  # [B] (value_type chunk_level) or [B, C] (action_level); None without critic
    forward_inputs: dict[str, Tensor]  # everything evaluate() needs besides the actions
    token_mask: Tensor | None = None  # [B, C, action_dim] bool: generated tokens; None = all


@dataclass
class EvaluateOutput:
    logprobs: Tensor  # [B, C, action_dim]
    entropy: Tensor  # [B, C, action_dim]
    values: Tensor | None


@dataclass
class ImitationOutput:
    """What a policy's head gives for demonstrated actions (``Policy.imitation``), with grad."""

    logprobs: Tensor | None  # [B, C, action_dim] log-likelihood per token; None for a regression head
    predicted: Tensor | None = None  # [B, C, action_dim] the greedy action, in the units of target
    target: Tensor | None = None  # [B, C, action_dim] the demonstrated action


def model_option(cfg: Mapping[str, Any], key: str) -> Any:
    """``cfg[key]`` of ``actor.model``, or one clear error naming the missing key."""
    if key not in cfg or cfg[key] is None:
        raise KeyError(f"actor.model.{key} is required by model_type {cfg.get('model_type')!r}")
    return cfg[key]


class Policy(nn.Module, ABC):
    """Base of all policies: the shape contract, the worker hooks and their defaults."""

    # The actor.model keys a class reads (each class lists its own; a policy reads those of its
    # classes), and the keys of its model schema it refuses when set, with why. tests/test_schema.py
    # checks that every key of a model's schema is read or refused.
    config_keys: ClassVar[tuple[str, ...]] = ("model_type", "action_dim", "num_action_chunks", "value_type")
    # The actor.model keys a training checkpoint fixes (what its weights were built for), which
    # evaluating or exporting it takes from its config (``checkpoint_settings``).
    checkpoint_keys: ClassVar[tuple[str, ...]] = ("model_type", "action_dim", "num_action_chunks", "add_value_head",
                                                  "value_type", "is_lora")
    # Those of them that the weights do not depend on: taken from the checkpoint unless the
    # command line sets them (e.g. a longer prompt for a new env's instructions).
    checkpoint_defaults: ClassVar[tuple[str, ...]] = ()
    refused_keys: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__()
        self.model_type = cfg.get("model_type")
        self.action_dim = int(model_option(cfg, "action_dim"))
        self.num_action_chunks = int(model_option(cfg, "num_action_chunks"))
        self.value_type = model_option(cfg, "value_type")
        self._home: torch.device | None = None  # where released weights return (release_weights)

    # ------------------------------------------------------------------ config
    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        """Checks of the options against the files they name (checkpoint folders), cheap enough
        to run in the driver before any worker starts; raise ``ConfigError``. None by default."""

    @classmethod
    def check_env(cls, cfg: Mapping[str, Any], env: EnvDescription, split: str) -> None:
        """Checks of the options against an env split's description (``split`` names it in
        messages); raise ``ConfigError``. Here what every policy shares: the action size, and the
        state size of a policy with ``state_dim``."""
        where = f"env.{split}" + (f" ({env.label})" if env.label else "")
        if env.action_dim is not None and int(cfg["action_dim"]) != env.action_dim:
            raise expected("actor.model.action_dim", cfg["action_dim"], f"{env.action_dim}, the action size of {where}")
        state = cfg.get("state_dim")
        if state and env.state_dim is not None and int(state) != env.state_dim:
            raise expected("actor.model.state_dim", state, f"{env.state_dim}, the length of obs['states'] of {where}")

    @classmethod
    def checkpoint_settings(cls, cfg: Mapping[str, Any], folder: Path) -> dict[str, Any]:
        """The ``actor.model`` options that the training checkpoint whose ``actor`` folder is
        ``folder`` fixes, from ``cfg``, the options it was trained with: ``embodied-eval`` and
        ``embodied-export`` take them from it (``embodied/config/preflight.py``). A LoRA run's adapters
        start from its own ``lora_adapter/`` (rank, alpha and target modules as trained), so the
        adapter the run started from need not exist any more."""
        from policies.lora import ADAPTER_CONFIG, ADAPTER_DIR

        settings = {key: cfg[key] for key in cls.checkpoint_keys if key in cfg}
        if cfg.get("is_lora") and (folder / ADAPTER_DIR / ADAPTER_CONFIG).is_file():
            settings["lora_path"] = str(folder / ADAPTER_DIR)
        return settings

    @classmethod
    def check_checkpoint(cls, cfg: Mapping[str, Any], folder: Path, key: str) -> None:
        """Checks of a training checkpoint's ``actor`` folder (named by config key ``key``)
        against the options, before any worker reads it; raise ``ConfigError``. Here the default
        layout: ``model.pt``'s names and shapes against the policy built on the meta device."""
        file = folder / MODEL_FILE
        if not file.is_file():
            raise CheckpointError(f"{key}: {file} is missing (the weights of a model_type {cfg['model_type']} "
                                  "checkpoint)")
        with torch.device("meta"):
            own = {k: tuple(v.shape) for k, v in cls(cfg).state_dict().items()}
        saved = torch.load(file, map_location="meta", weights_only=True)
        check_keys(own, {k: tuple(v.shape) for k, v in saved.items()}, f"{key}: checkpoint {file}")

    @classmethod
    def unread_keys(cls, cfg: Mapping[str, Any]) -> dict[str, str]:
        """Keys that these options leave unread though the model type reads them under others
        (e.g. a head's options with another head), with why; the config layer refuses them when
        set, beside the keys that only other model types read (``reads`` in policies/__init__.py)."""
        out = {}
        if not cfg.get("is_lora"):
            out["actor.model.lora_path"] = "a LoRA adapter needs actor.model.is_lora true"
        if not cfg.get("add_value_head"):  # (a model with a value head MLP has the key)
            out["actor.model.value_head_hidden_sizes"] = "a value head's widths need actor.model.add_value_head true"
        return out

    # ----------------------------------------------------------------- rollout
    @abstractmethod
    def act(self, obs: Mapping[str, Any], do_sample: bool = True, temperature: float | None = None) -> ActOutput:
        """Choose actions for a batch of observations (sampled, or greedy with ``do_sample=False``);
        ``temperature`` replaces the policy's own for this call (evaluation's
        ``temperature_eval``) where it samples token logits."""

    @property
    def has_value_head(self) -> bool:
        """Whether ``act`` and ``evaluate`` return values (PPO's critic)."""
        return False

    @torch.no_grad()
    def values(self, obs: Mapping[str, Any]) -> Tensor | None:
        """Values of a batch of observations, without choosing actions (the bootstrap of a
        rollout's last observation); a policy with a separate critic overrides this."""
        return self.act(obs, do_sample=False).values

    # ---------------------------------------------------------------- training
    @abstractmethod
    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        """Log-probs, entropy and values of ``actions`` given stored ``forward_inputs``, with grad."""

    def forward(self, forward_inputs: Mapping[str, Tensor], actions: Tensor,
                imitation: bool = False) -> EvaluateOutput | ImitationOutput:
        return self.imitation(forward_inputs, actions) if imitation else self.evaluate(forward_inputs, actions)

    # ------------------------------------------------------------ imitation (SFT)
    @torch.no_grad()
    def imitation_inputs(self, obs: Mapping[str, Any], actions: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """Demonstrated observations and action chunks (``[B, C, action_dim]``, env units) ->
        ``(forward_inputs, actions)`` as a rollout would have stored them had the policy chosen
        these actions: by default ``act``'s (greedy) inputs and the actions as given. A policy
        whose stored actions are not the env's (tokens, normalized values) overrides it."""
        return self.act(obs, do_sample=False).forward_inputs, torch.as_tensor(actions, dtype=torch.float32)

    def imitation(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> ImitationOutput:
        """What the imitation loss trains on (``embodied/algorithms/imitation.py``), with grad:
        by default the log-probs ``evaluate`` gives the demonstrated actions (their NLL)."""
        return ImitationOutput(self.evaluate(forward_inputs, actions).logprobs)

    @classmethod
    def imitation_options(cls, cfg: Mapping[str, Any], actions: np.ndarray, states: np.ndarray | None,
                          dataset: str, folder: Path) -> dict[str, Any]:
        """The ``actor.model`` options an SFT run trains, given every demonstrated action
        (``[N, action_dim]``, env units) and proprio state (``[N, D]``, None without) of the
        dataset named ``dataset``; ``folder`` is the run's own, for what they must write. By
        default the options as they are (a policy that normalizes by statistics writes a
        checkpoint folder holding the demos' there)."""
        return dict(cfg)

    @torch.no_grad()
    def probe_logprobs(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> Tensor:
        """Per-token log-probs of stored ``actions`` under the model itself (no sampling
        temperature), as CPU floats: what two copies of the same weights (the actor's, a
        rollout engine's) must agree on after a weight sync."""
        self.eval()
        return self(forward_inputs, actions).logprobs.float().cpu()  # through forward: FSDP's hooks fire

    def shard_units(self) -> list[nn.Module]:
        """Modules an FSDP actor shards one by one before the policy itself (a large model's
        blocks); none by default: the whole policy is one unit."""
        return []

    def enable_gradient_checkpointing(self) -> list[nn.Module]:
        """Recompute the activations of the policy's layers in the backward pass
        (``actor.model.gradient_checkpointing``), applied before sharding; returns the modules
        that recompute."""
        raise ConfigError(f"actor.model.gradient_checkpointing: not supported by model_type {self.model_type}")

    def value_parameters(self) -> list[nn.Parameter]:
        """The critic's parameters, which train with ``actor.optim.value_lr`` (none by default)."""
        return []

    def frozen_reference(self) -> contextlib.AbstractContextManager | None:
        """A context in which this policy computes as the KL reference (a LoRA policy's frozen
        base, adapters off), or None when all its weights train: the actor then keeps a frozen
        copy of the initial policy."""
        return None

    # ----------------------------------------------------------------- weights
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def trains_all_weights(self) -> bool:
        return all(p.requires_grad for p in self.parameters())

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What changes in training, as full CPU tensors (module docstring): the weight sync to
        the rollout copies. Gathers FSDP2 shards, so every rank must call it."""
        if self.trains_all_weights():
            return {k: full_tensor(v) for k, v in self.state_dict().items()}
        return {k: full_tensor(p) for k, p in self.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def load_trainable_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Take a ``trainable_state_dict`` (same names and shapes, or an error naming them); after
        ``release_weights`` of whole weights, the tensors are taken as they come."""
        if self.trains_all_weights():
            if self._home is None:
                self.load_state_dict(state)
                return
            dtypes = {k: v.dtype for k, v in self.state_dict().items()}
            self.load_state_dict({k: v.to(self._home, dtypes.get(k, v.dtype)) for k, v in state.items()}, assign=True)
            self._home = None
            return
        params = {k: p for k, p in self.named_parameters() if p.requires_grad}
        check_keys({k: tuple(p.shape) for k, p in params.items()},
                   {k: tuple(v.shape) for k, v in state.items()}, "trainable state dict")
        for name, p in params.items():
            p.copy_(state[name])

    def release_weights(self) -> None:
        """Free the weights' memory while a rollout copy idles. Weights that a sync brings back
        whole become meta tensors (shapes only) until ``load_trainable_state_dict``; a frozen
        base, which no sync carries, moves to host memory until ``restore_weights``."""
        if self._home is not None:
            return
        self._home = self.device
        if self.trains_all_weights():
            _to_meta(self)
        else:
            self.to("cpu")

    def restore_weights(self) -> None:
        """A released frozen base back onto its device (whole weights return with the next sync)."""
        if self._home is not None and not self.trains_all_weights():
            self.to(self._home)
            self._home = None

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the training state of the weights into folder ``path`` (here: the full state
        dict as ``model.pt``; a policy with its own layout overrides this and ``read_checkpoint``).
        Gathers FSDP2 shards, so every rank must call it; rank 0 writes."""
        state = {k: full_tensor(v) for k, v in self.state_dict().items()}
        if is_writer():
            Path(path).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(path) / MODEL_FILE)

    def read_checkpoint(self, path: str | Path) -> dict[str, Tensor]:
        """What ``save_checkpoint`` wrote, as a state dict of this policy (CPU tensors); a
        policy that saves only what it trains (LoRA) returns only those tensors."""
        file = Path(path) / MODEL_FILE
        if not file.exists():
            raise FileNotFoundError(f"{file} is missing (expected the weights of a training checkpoint)")
        return torch.load(file, map_location="cpu", weights_only=True)

    def export_pretrained(self, path: str | Path) -> None:
        """Write the policy as one pretrained checkpoint folder that ``model_path`` reads back
        (``embodied-export``); only models with a published folder layout have one."""
        raise ConfigError(f"actor.model.model_type={self.model_type!r} has no checkpoint-folder export")


@torch.no_grad()
def _to_meta(model: nn.Module) -> None:
    """Every tensor of ``model.state_dict()`` becomes a meta tensor (same shape and dtype, no
    storage); ``load_state_dict(..., assign=True)`` restores them. Non-persistent buffers, which
    no state dict carries, stay as they are."""
    for name in model.state_dict():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        tensor = getattr(module, attr)
        meta = tensor.to("meta")
        setattr(module, attr, nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta)
