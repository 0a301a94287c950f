"""Advantage estimators over time-major trajectories ``[T, B]``.

Conventions shared by every function here (see ``levels.py`` for how env chunks become steps):
``rewards[t]`` is the reward of the action taken at step ``t``; ``terminations[t]`` /
``truncations[t]`` say the episode ended with that action (a terminated episode has no future,
a truncated one was cut by a time limit and still has one, so it bootstraps from a value).
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def grpo_advantages(scores: Tensor, group_size: int, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    """Group-normalized advantages ``(score - group mean) / (group std + eps)``, ``[B]``; with
    ``normalize_std=False`` only the mean is subtracted (Dr. GRPO: dividing by the std weighs
    nearly-solved and nearly-failed prompts more).

    Envs ``[g * group_size, (g + 1) * group_size)`` form group ``g`` and started from the same
    reset state, so the group mean is a baseline for that state. The std is the unbiased sample
    std (as common GRPO implementations use); a group with equal scores gets advantage 0.
    """
    if group_size < 2:
        raise ValueError(f"GRPO needs group_size >= 2 (envs per shared reset state), got {group_size}")
    if scores.shape[0] % group_size:
        raise ValueError(f"number of envs {scores.shape[0]} is not a multiple of group_size {group_size}")
    groups = scores.reshape(-1, group_size).to(torch.float32)
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
    if scores.shape[0] % group_size:
        raise ValueError(f"number of envs {scores.shape[0]} is not a multiple of group_size {group_size}")
    groups = scores.reshape(-1, group_size)
    spread = groups.amax(dim=1) != groups.amin(dim=1)
    return spread.repeat_interleave(group_size)


def normalize_advantages(advantages: Tensor, mask: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """Zero-mean, unit-std advantages over the valid entries (masked entries become 0).

    Uses the unbiased std, as CleanRL's PPO does.
    """
    if mask is None:
        return (advantages - advantages.mean()) / (advantages.std() + eps)
    mask = mask.bool()
    valid = advantages[mask]
    if valid.numel() < 2:
        return torch.zeros_like(advantages)
    normalized = (advantages - valid.mean()) / (valid.std() + eps)
    return torch.where(mask, normalized, torch.zeros_like(normalized))
