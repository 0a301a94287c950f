"""``act`` / ``evaluate`` shared by the small policies (MLP, CNN).

A subclass turns raw observations into tensors (``preprocess``, whose output is stored as
``forward_inputs``) and computes the action distribution and values from them
(``distribution_and_values``); everything else is the same for both.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Distribution

from policies.action_heads import VALUE_GAIN, build_action_head, layer_init, unread_head_keys
from policies.base import ActOutput, EvaluateOutput, ImitationOutput, Policy, model_option


class SmallActorCritic(Policy):
    config_keys = ("hidden_dims", "state_dim", "action_distribution", "n_action_bins", "init_log_std",
                   "add_value_head", "gradient_checkpointing")
    refused_keys = {"is_lora": "LoRA adapters, because small policies train all their weights"}

    @classmethod
    def unread_keys(cls, cfg: Mapping[str, Any]) -> dict[str, str]:
        return super().unread_keys(cfg) | unread_head_keys(cfg["action_distribution"])

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__(cfg)
        self.add_value_head = bool(model_option(cfg, "add_value_head"))
        self.hidden_dims = [int(w) for w in model_option(cfg, "hidden_dims")]
        if not self.hidden_dims or min(self.hidden_dims) < 1:
            raise ValueError(f"actor.model.hidden_dims must be a non-empty list of widths, got {self.hidden_dims}")

    @property
    def has_value_head(self) -> bool:
        return self.add_value_head

    def value_parameters(self) -> list[nn.Parameter]:
        return list(self.value_head.parameters()) if self.add_value_head else []

    def enable_gradient_checkpointing(self) -> list[nn.Module]:
        """Each layer stack (an ``nn.Sequential`` child: the actor's and the critic's trunks, the
        CNN's encoder) keeps only its input in the forward pass and recomputes its activations in
        the backward pass."""
        from torch.distributed._composable import checkpoint

        stacks = [m for m in self.children() if isinstance(m, nn.Sequential)]
        for stack in stacks:
            checkpoint(stack)
        return stacks

    def _make_action_head(self, cfg: Mapping[str, Any]) -> nn.Module:
        return build_action_head(cfg, self.hidden_dims[-1], self.num_action_chunks, self.action_dim)

    def _value_output(self) -> nn.Linear:
        """Last critic layer: one value per chunk, or one per action of the chunk."""
        width = self.num_action_chunks if self.value_type == "action_level" else 1
        return layer_init(nn.Linear(self.hidden_dims[-1], width), VALUE_GAIN)

    def _values(self, raw: Tensor) -> Tensor:
        # a fresh tensor, not a view: FSDP2 hooks on a returned view break under in-place ops
        return raw.squeeze(-1).clone() if self.value_type == "chunk_level" else raw

    @abstractmethod
    def preprocess(self, obs: Mapping[str, Any]) -> dict[str, Tensor]:
        """Batched obs (numpy or torch) -> the tensors the model reads, on the model's device."""

    @abstractmethod
    def distribution_and_values(self, inputs: Mapping[str, Tensor]) -> tuple[Distribution, Tensor | None]:
        """Action distribution over ``[B, C, action_dim]`` and values (None without critic)."""

    @abstractmethod
    def critic_features(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """What the value head reads."""

    @torch.no_grad()
    def values(self, obs: Mapping[str, Any]) -> Tensor | None:
        if not self.add_value_head:
            return None
        return self._values(self.value_head(self.critic_features(self.preprocess(obs))))

    @torch.no_grad()
    def act(self, obs: Mapping[str, Any], do_sample: bool = True, temperature: float | None = None) -> ActOutput:
        # no temperature: the heads sample no token logits (temperature_eval is refused for them);
        # no_grad rather than inference_mode: forward_inputs are reused in training's autograd
        inputs = self.preprocess(obs)
        dist, values = self.distribution_and_values(inputs)
        actions = self.action_head.sample(dist, do_sample)
        return ActOutput(actions, self.action_head.log_prob(dist, actions), values, inputs)

    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        dist, values = self.distribution_and_values(forward_inputs)
        actions = torch.as_tensor(actions, dtype=torch.float32, device=self.device)
        return EvaluateOutput(self.action_head.log_prob(dist, actions), dist.entropy(), values)

    def imitation(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> ImitationOutput:
        """Behaviour cloning by maximum likelihood: the head's log-probs of the demonstrated
        actions (Gaussian: NLL per dim, the log-std fitted too; bins: cross-entropy on the
        nearest bin), with the greedy action (mean, or likeliest bin) beside them."""
        dist, _ = self.distribution_and_values(forward_inputs)
        actions = torch.as_tensor(actions, dtype=torch.float32, device=self.device)
        return ImitationOutput(self.action_head.log_prob(dist, actions), self.action_head.sample(dist, False), actions)


def obs_tensor(obs: Mapping[str, Any], key: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """A fresh copy of ``obs[key]`` (channels may reuse their buffers, and forward_inputs must
    outlive them) whose trailing dims must equal ``shape``; one clear error if not."""
    if key not in obs:
        raise KeyError(f"the policy reads obs[{key!r}] {list(shape)} per env; the env gave {sorted(obs)}")
    value = obs[key]
    if isinstance(value, Tensor):
        x = value.to(device=device, dtype=dtype, copy=True)
    else:
        x = torch.tensor(np.asarray(value), dtype=dtype, device=device)
    if tuple(x.shape[1:]) != shape:
        raise ValueError(
            f"obs[{key!r}] has shape {list(x.shape)}, expected [B, {', '.join(map(str, shape))}] "
            "(check actor.model against the env)"
        )
    return x
