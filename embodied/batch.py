"""The one batch type between rollout and actor: a dataclass of tensors.

A ``Trajectory`` is what a rollout rank collects and sends an actor rank through the channel
(time-major ``[T, B, ...]``); ``Samples`` is what the loss trains on after the advantages
(``[N, ...]`` with ``N = T * B``); SFT trains on ``DemoSamples`` instead. All are
``TensorBatch``es: fields are tensors, a dict of tensors (the policy's ``forward_inputs``) or None
(a field this run does not have, e.g. values without a critic), and ``map`` / ``cat`` reach every
tensor, so moving, slicing and joining a batch is one line. The channel carries a dataclass as it is (its arrays through shared memory).

Plain dataclasses rather than TensorDict: two fixed field lists say what travels, and the
dependency would bring its own torch pin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch
from torch import Tensor

B = TypeVar("B", bound="TensorBatch")


def _map(fn: Callable[[Tensor], Any], value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    return fn(value)


def _cat(values: Sequence[Any], dim: int) -> Any:
    if values[0] is None:
        return None
    if isinstance(values[0], dict):
        return {k: torch.cat([v[k] for v in values], dim=dim) for k in values[0]}
    return torch.cat(list(values), dim=dim)


@dataclass
class TensorBatch:
    def map(self: B, fn: Callable[[Tensor], Any]) -> B:
        """The same batch with ``fn`` applied to every tensor (e.g. a slice, a device move)."""
        return replace(self, **{f.name: _map(fn, getattr(self, f.name)) for f in fields(self)})

    @classmethod
    def cat(cls: type[B], batches: Sequence[B], dim: int) -> B:
        """The batches joined along ``dim`` (1: more envs of a trajectory; 0: more samples)."""
        return cls(**{f.name: _cat([getattr(b, f.name) for b in batches], dim) for f in fields(cls)})


@dataclass
class Trajectory(TensorBatch):
    """``T`` chunk steps of ``B`` envs, as the rollout recorded them."""

    forward_inputs: dict[str, Tensor]  # [T, B, ...] what Policy.evaluate needs besides the actions
    actions: Tensor  # [T, B, C, A]
    logprobs: Tensor  # [T, B, C, A] per token, of the policy that acted
    token_mask: Tensor  # [T, B, C, A] bool: generated tokens of variable-length actions (all for fixed ones)
    rewards: Tensor  # [T, B, C]
    terminations: Tensor  # [T, B, C] bool, in the chunk's last slot
    truncations: Tensor  # [T, B, C] bool
    values: Tensor | None = None  # [T + 1, B] or [T + 1, B, C] with a critic (the last row bootstraps)
    final_values: Tensor | None = None  # [T, B] value of the observation an episode ended on
    versions: Tensor | None = None  # [T, B] int: the weight version (updates applied) that acted


@dataclass
class Samples(TensorBatch):
    """Training samples: one per chunk step of one env (or text response), ``[N, ...]``."""

    forward_inputs: dict[str, Tensor]
    actions: Tensor  # [N, C, A]
    old_logprobs: Tensor  # at algorithm.logprob_type: [N], [N, C] or [N, C, A]
    advantages: Tensor  # at algorithm.reward_type: [N] or [N, C]
    mask: Tensor  # like advantages, bool: the samples that train
    token_mask: Tensor  # [N, C, A] bool
    returns: Tensor | None = None  # value targets, with a critic
    old_values: Tensor | None = None  # the rollout's values, with a critic
    ref_logprobs: Tensor | None = None  # the KL reference's, when the KL is a loss term
    proximal_logprobs: Tensor | None = None  # the policy's at the start of the update (decoupled PPO)
    is_weights: Tensor | None = None  # at logprob_type: truncated pi_old / pi_rollout (importance_sampling_fix)


@dataclass
class DemoSamples(TensorBatch):
    """Demonstrated steps, what SFT trains on (``[N, ...]``): the inputs the policy would have
    stored for the step's observation, and the demonstration's action chunk from that step."""

    forward_inputs: dict[str, Tensor]
    actions: Tensor  # [N, C, A] as Policy.imitation reads them
