"""Advantage estimators over time-major trajectories ``[T, B]``.

Conventions shared by every function here (see ``levels.py`` for how env chunks become steps):
``rewards[t]`` is the reward of the action taken at step ``t``; ``terminations[t]`` /
``truncations[t]`` say the episode ended with that action (a terminated episode has no future,
a truncated one was cut by a time limit and still has one, so it bootstraps from a value).

Estimators register themselves by ``algorithm.adv_type`` (``ADVANTAGES``) with what they need
declared beside them, which validation and the actor read: a new one is a decorated function of
``(StepSignals, algorithm options) -> Estimate`` here, plus its name in config/base.yaml's choices.
Its ``reads`` are the keys it reads and, for an estimator that gives value targets, the keys of
the critic's training those targets drive; under another estimator they are refused when set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from core.registry import Registry

# the config keys read here whatever the estimator (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("algorithm.group_size",)

ADVANTAGES = Registry(
    "advantage estimator", "algorithm.adv_type",
    needs_value_head=False,  # reads the critic's values: the policy needs actor.model.add_value_head
    needs_groups=False,  # compares envs of a group that share a reset state (algorithm.group_size >= 2)
    normalize=False,  # algorithm.normalize_advantages whitens them over the batch (not when already normalized)
)


@dataclass
class StepSignals:
    """What an estimator reads: one trajectory's env signals at the reward level, ``[T, B]``."""

    rewards: Tensor
    terminations: Tensor  # bool
    truncations: Tensor  # bool
    values: Tensor | None = None  # [T + 1, B] with a critic
    final_values: Tensor | None = None  # [T, B] value of the observation an episode ended on


@dataclass
class Estimate:
    advantages: Tensor  # [T, B]
    mask: Tensor  # [T, B] bool: the steps that train
    returns: Tensor | None = None  # [T, B] value targets, for estimators that use the critic


CRITIC_TRAINING = {
    "algorithm.value_clip": "the value loss's clip",
    "algorithm.huber_delta": "the value loss's Huber threshold",
    "algorithm.value_loss_coef": "the value loss's weight",
    "algorithm.critic_warmup": "steps that train the critic alone",
    "algorithm.bootstrap_at_done": "bootstrapping from the critic at an episode's end",
}


@ADVANTAGES.register("gae", needs_value_head=True, normalize=True, reads={
    "algorithm.gamma": "the discount", "algorithm.gae_lambda": "the GAE lambda",
    "algorithm.normalize_advantages": "whitening over the batch", **CRITIC_TRAINING})
def gae(steps: StepSignals, algo: Mapping[str, Any]) -> Estimate:
    """PPO's generalized advantage estimation (``compute_gae``); every step trains."""
    advantages, returns = compute_gae(steps.rewards, steps.values, steps.terminations, steps.truncations,
                                      algo["gamma"], algo["gae_lambda"], steps.final_values)
    return Estimate(advantages, torch.ones_like(advantages, dtype=torch.bool), returns)


@ADVANTAGES.register("grpo", needs_groups=True, reads={
    "algorithm.norm_adv_by_std_in_grpo": "dividing by the group's std",
    "algorithm.filter_rewards": "dropping groups that all scored the same"})
def grpo(steps: StepSignals, algo: Mapping[str, Any]) -> Estimate:
    """Each env's first-episode return, normalized within its group (``grpo_advantages``), on
    every step of that episode; with ``filter_rewards`` groups that all scored the same drop out."""
    dones = steps.terminations | steps.truncations
    mask = first_episode_mask(dones)
    scores = episode_returns(steps.rewards, dones)
    if algo["filter_rewards"]:
        mask = mask & nonuniform_group_mask(scores, algo["group_size"])
    advantages = grpo_advantages(scores, algo["group_size"], normalize_std=algo["norm_adv_by_std_in_grpo"])
    return Estimate(advantages.expand_as(steps.rewards) * mask, mask)


@ADVANTAGES.register("reinpp", normalize=True, reads={"algorithm.normalize_advantages": "whitening over the batch"})
def reinpp(steps: StepSignals, algo: Mapping[str, Any]) -> Estimate:
    """REINFORCE++ (Hu et al., 2025): each step's undiscounted return-to-go in its env's first
    episode, no critic and no group; ``normalize`` whitens them over the global batch, which is
    the method's only baseline. A KL to the reference (``kl_beta`` with ``use_kl_in_reward``) is
    already in the rewards, so it enters the return of every step before it."""
    mask = first_episode_mask(steps.terminations | steps.truncations)
    return Estimate(returns_to_go(steps.rewards * mask) * mask, mask)


@ADVANTAGES.register("reinpp_baseline", needs_groups=True, normalize=True,
                     reads={"algorithm.normalize_advantages": "whitening over the batch"})
def reinpp_baseline(steps: StepSignals, algo: Mapping[str, Any]) -> Estimate:
    """REINFORCE++-baseline: REINFORCE++ with the mean score of the env's group (its shared reset
    state or prompt) subtracted from every step's return first, then whitened over the batch."""
    plain = reinpp(steps, algo)
    scores = plain.advantages[0]  # a first episode's return-to-go at its first step: its score
    return Estimate((plain.advantages - group_means(scores, algo["group_size"])) * plain.mask, plain.mask)


def compute_gae(
    rewards: Tensor,
    values: Tensor,
    terminations: Tensor,
    truncations: Tensor,
    gamma: float,
    gae_lambda: float,
    final_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation; returns ``(advantages, returns)``, both ``[T, B]``.

    ``values`` is ``[T + 1, B]``: V(s_0) .. V(s_T), the last row being the value of the
    observation after the final step. A step bootstraps from the value of the observation that
    followed it in the *same* episode:

    - terminated: no bootstrap (its future is worth 0);
    - truncated: ``final_values[t]`` (value of the episode's final observation) when given,
      else ``values[t + 1]``, which is right when envs do not auto-reset (the next observation
      *is* the final one);
    - otherwise ``values[t + 1]``.

    Any end of episode stops the backward recursion, so a new episode never leaks into the old
    one's advantage. ``returns = advantages + values[:-1]`` are the value targets.
    """
    steps = rewards.shape[0]
    if values.shape[0] != steps + 1:
        raise ValueError(f"values needs T + 1 = {steps + 1} rows (last one bootstraps), got {values.shape[0]}")
    next_values = values[1:]
    if final_values is not None:
        next_values = torch.where(truncations.bool(), final_values, next_values)
    not_terminated = 1.0 - terminations.to(rewards.dtype)
    not_done = 1.0 - (terminations.bool() | truncations.bool()).to(rewards.dtype)

    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(steps)):
        delta = rewards[t] + gamma * not_terminated[t] * next_values[t] - values[t]
        running = delta + gamma * gae_lambda * not_done[t] * running
        advantages[t] = running
    return advantages, advantages + values[:-1]


def first_episode_mask(dones: Tensor) -> Tensor:
    """``[T, B]`` bool: True for the steps of each env's first episode (up to and including its
    first done). Without auto-reset, steps after that are the stale tail of a finished episode
    and must not train."""
    dones = dones.bool().long()
    ended_before = torch.cumsum(dones, dim=0) - dones
    return ended_before == 0


def episode_returns(rewards: Tensor, dones: Tensor) -> Tensor:
    """``[B]``: undiscounted return of each env's first episode (its score for GRPO)."""
    return (rewards * first_episode_mask(dones)).sum(dim=0)


def returns_to_go(rewards: Tensor) -> Tensor:
    """``[T, B]``: the undiscounted sum of each step's reward and all after it."""
    return rewards.flip(0).cumsum(0).flip(0)


def _groups(scores: Tensor, group_size: int) -> Tensor:
    """``[B] -> [G, group_size]``: envs ``[g * group_size, (g + 1) * group_size)`` form group ``g``."""
    if scores.shape[0] % group_size:
        raise ValueError(f"number of envs {scores.shape[0]} is not a multiple of group_size {group_size}")
    return scores.reshape(-1, group_size)


def group_means(scores: Tensor, group_size: int) -> Tensor:
    """``[B]``: the mean score of each env's group."""
    return _groups(scores, group_size).mean(dim=1).repeat_interleave(group_size)


def grpo_advantages(scores: Tensor, group_size: int, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    """Group-normalized advantages ``(score - group mean) / (group std + eps)``, ``[B]``; with
    ``normalize_std=False`` only the mean is subtracted (Dr. GRPO: dividing by the std weighs
    nearly-solved and nearly-failed prompts more).

    Envs ``[g * group_size, (g + 1) * group_size)`` form group ``g`` and started from the same
    reset state, so the group mean is a baseline for that state (with ``env.train.group_size``
    smaller, as RLinf's LIBERO-10 config has it, from runs of that many envs per state: then the
    mean is a baseline over those states). The std is the unbiased sample
    std (as common GRPO implementations use); a group with equal scores gets advantage 0.
    """
    if group_size < 2:
        raise ValueError(f"GRPO needs group_size >= 2 (envs per shared reset state), got {group_size}")
    groups = _groups(scores, group_size).to(torch.float32)
    mean = groups.mean(dim=1, keepdim=True)
    if not normalize_std:
        return (groups - mean).reshape(-1)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1)


def nonuniform_group_mask(scores: Tensor, group_size: int) -> Tensor:
    """``[B]`` bool: False for envs whose whole group scored the same.

    With success flags as scores this drops all-success and all-failure groups: they carry no
    ranking signal (their advantages are 0) yet would dilute the mean over valid samples.
    """
    groups = _groups(scores, group_size)
    spread = groups.amax(dim=1) != groups.amin(dim=1)
    return spread.repeat_interleave(group_size)


def normalize_advantages(advantages: Tensor, mask: Tensor | None = None, *, correction: int = 1,
                         all_reduce: Callable[[Tensor], Any] | None = None, eps: float = 1e-8) -> Tensor:
    """Zero-mean, unit-std advantages over the valid entries (masked entries become 0).

    The std takes ``correction`` (1: unbiased, as CleanRL's PPO; 0: the population's). With
    ``all_reduce`` (an in-place sum over data-parallel ranks) the moments are those of the global
    batch, so every rank whitens alike.
    """
    weights = torch.ones_like(advantages) if mask is None else mask.to(advantages.dtype)
    stats = torch.stack([(advantages * weights).sum(), (advantages * advantages * weights).sum(),
                         weights.sum()]).double()
    if all_reduce is not None:
        all_reduce(stats)
    total, total_sq, n = stats.tolist()
    mean = total / max(n, 1)
    variance = max(total_sq / max(n, 1) - mean * mean, 0.0) * (n / max(n - correction, 1))
    return (advantages - mean) / (variance ** 0.5 + eps) * weights
