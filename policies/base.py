"""The policy interface every model in ``policies/`` implements (see DESIGN.md).

Rollout calls ``act(obs)`` under no_grad and stores its ``forward_inputs`` and ``actions``;
training calls ``evaluate(forward_inputs, actions)`` (also reachable as ``policy(...)``, so
FSDP's forward hooks fire) to recompute log-probs with gradients. Log-probs and entropies come
per token, ``[B, num_action_chunks, action_dim]`` (a token is one action dim: a bin index for
discretized actions, one coordinate for Gaussian ones, one generated token of a text response);
``reduce_logprobs`` sums them to the level of ``algorithm.logprob_type`` / ``entropy_type``.

Variable-length actions: a text response is ``action_dim = max_new_tokens`` token ids padded
after EOS, and ``ActOutput.token_mask`` (``[B, C, action_dim]`` bool) marks the tokens that were
really generated. Fixed-size policies leave it ``None``: every token counts. Masked tokens carry
log-prob 0, and the actor leaves them out of every loss term.

Checkpoints: the actor calls ``save_checkpoint(folder)`` (every rank; rank 0 writes) and
``read_checkpoint(folder)`` (a state dict to load, possibly only the trained tensors); a rollout
worker evaluating a checkpoint loads the same state dict. The default is one ``model.pt``; a
policy with a published folder layout (OpenVLA-OFT: peft adapters, head files; the causal LM
with LoRA: the peft adapter) overrides both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from embodied.schema import check, unknown_choice
from policies.weights import full_tensor, is_writer

MODEL_FILE = "model.pt"
VALUE_HEAD = "value_head"  # attribute name of the critic part, which trains with optim.value_lr


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


def reduce_logprobs(logprobs: Tensor, level: str) -> Tensor:
    """Per-token ``[B, C, action_dim]`` -> ``token_level`` (unchanged), ``action_level``
    (``[B, C]``, joint over an action's dims) or ``chunk_level`` (``[B]``, joint over the chunk).
    Tokens are sampled independently given the observation, so joint log-probs are sums."""
    if level == "token_level":
        return logprobs
    if level == "action_level":
        return logprobs.sum(dim=-1)
    if level == "chunk_level":
        return logprobs.sum(dim=(-2, -1))
    raise unknown_choice("algorithm.logprob_type", level)


def model_option(cfg: Mapping[str, Any], key: str) -> Any:
    """``cfg[key]`` of ``actor.model``, or one clear error naming the missing key."""
    if key not in cfg or cfg[key] is None:
        raise KeyError(f"actor.model.{key} is required by model_type {cfg.get('model_type')!r}")
    return cfg[key]


class Policy(nn.Module, ABC):
    """Base of all policies: the shape contract and the common config keys."""

    # The actor.model keys a class reads (each class lists its own; a policy reads those of its
    # classes), and the keys of its model schema it refuses when set, with why. tests/test_schema.py
    # checks that every key of a model's schema is read or refused.
    config_keys: ClassVar[tuple[str, ...]] = ("model_type", "action_dim", "num_action_chunks", "value_type")
    refused_keys: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__()
        check(cfg, "actor.model.", cfg.get("model_type"))
        self.action_dim = int(model_option(cfg, "action_dim"))
        self.num_action_chunks = int(model_option(cfg, "num_action_chunks"))
        self.value_type = model_option(cfg, "value_type")

    @abstractmethod
    def act(self, obs: Mapping[str, Any], do_sample: bool = True) -> ActOutput:
        """Choose actions for a batch of observations (sampled, or greedy with ``do_sample=False``)."""

    @abstractmethod
    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        """Log-probs, entropy and values of ``actions`` given stored ``forward_inputs``, with grad."""

    def forward(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        return self.evaluate(forward_inputs, actions)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

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


def split_value_parameters(policy: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(policy_params, value_params)``: the value head trains with its own ``optim.value_lr``."""
    value, rest = [], []
    for name, param in policy.named_parameters():
        (value if VALUE_HEAD in name.split(".") else rest).append(param)
    return rest, value
