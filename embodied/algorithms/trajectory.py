"""From a rollout's time-major trajectory to flat training samples with advantages.

A trajectory holds ``T`` chunk steps of ``B`` envs: ``forward_inputs`` (dict of ``[T, B, ...]``),
``actions`` / ``logprobs`` / ``token_mask`` ``[T, B, C, A]`` (the mask marks generated tokens of
variable-length actions; all true for fixed-size ones), env signals ``rewards`` / ``terminations`` /
``truncations`` ``[T, B, C]``, and with a critic ``values`` ``[T + 1, B(, C)]`` and
``final_values`` ``[T, B]`` (value of the observation an episode ended on, for truncation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from embodied.algorithms.advantages import (
    compute_gae,
    episode_returns,
    first_episode_mask,
    grpo_advantages,
    nonuniform_group_mask,
)
from embodied.algorithms.kl import kl_penalty
from embodied.algorithms.levels import (
    check_levels,
    chunks_to_steps,
    final_values_to_steps,
    steps_to_chunks,
    values_to_steps,
)
from embodied.schema import unknown_choice
from policies.base import reduce_logprobs

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("algorithm.adv_type", "algorithm.group_size", "algorithm.gamma", "algorithm.gae_lambda",
               "algorithm.bootstrap_at_done", "algorithm.norm_adv_by_std_in_grpo", "algorithm.kl_penalty",
               "algorithm.filter_rewards", "algorithm.reward_type")


def training_samples(traj: Mapping[str, Any], algo: Mapping[str, Any],
                     ref_logprobs: Tensor | None = None) -> dict[str, Any]:
    """Advantages (GAE or GRPO) on the reward level, then everything flattened to ``N = T * B``
    samples: ``forward_inputs``, ``actions``, ``old_logprobs`` (at ``logprob_type``),
    ``advantages`` / ``mask`` (and ``returns`` / ``old_values`` with a critic) as ``[N]`` or
    ``[N, C]``, and ``ref_logprobs`` when the KL goes into the loss.

    With ``bootstrap_at_done: always`` a terminated episode bootstraps from its final
    observation's value like a truncated one. ``ref_logprobs`` (per token, ``[T, B, C, A]``) are
    the reference policy's; with
    ``use_kl_in_reward`` their KL is subtracted from the rewards before the advantages.
    """
    reward_type, level = algo["reward_type"], algo["logprob_type"]
    check_levels(reward_type, level)
    steps, batch, chunks = traj["rewards"].shape
    rewards = traj["rewards"].float()
    kl_in_reward = ref_logprobs is not None and algo["use_kl_in_reward"] and algo["kl_beta"] > 0
    if kl_in_reward:
        token_kl = kl_penalty(traj["logprobs"], ref_logprobs, algo["kl_penalty"])
        rewards = rewards - algo["kl_beta"] * token_kl.sum(dim=-1)
    rewards = chunks_to_steps(rewards, reward_type)
    terminations = chunks_to_steps(traj["terminations"].bool(), reward_type, "any")
    truncations = chunks_to_steps(traj["truncations"].bool(), reward_type, "any")
    if algo["bootstrap_at_done"] == "always":
        # every episode end bootstraps, as if cut by a time limit (see config/base.yaml)
        terminations, truncations = torch.zeros_like(terminations), terminations | truncations
    dones = terminations | truncations

    out: dict[str, Any] = {}
    if algo["adv_type"] == "gae":
        values = values_to_steps(traj["values"].float(), reward_type)
        final = traj.get("final_values")
        if final is not None:
            final = final_values_to_steps(final.float(), chunks, reward_type)
        advantages, returns = compute_gae(rewards, values, terminations, truncations,
                                          algo["gamma"], algo["gae_lambda"], final)
        mask = torch.ones_like(advantages, dtype=torch.bool)
        out["returns"] = _flat(steps_to_chunks(returns, chunks, reward_type))
        out["old_values"] = _flat(steps_to_chunks(values[:-1], chunks, reward_type))
    elif algo["adv_type"] == "grpo":
        mask = first_episode_mask(dones)
        scores = episode_returns(rewards, dones)
        if algo["filter_rewards"]:
            mask = mask & nonuniform_group_mask(scores, algo["group_size"])
        advantages = grpo_advantages(scores, algo["group_size"], normalize_std=algo["norm_adv_by_std_in_grpo"])
        advantages = advantages.expand_as(rewards) * mask
    else:
        raise unknown_choice("algorithm.adv_type", algo["adv_type"])

    out["advantages"] = _flat(steps_to_chunks(advantages, chunks, reward_type))
    out["mask"] = _flat(steps_to_chunks(mask, chunks, reward_type))
    out["actions"] = _flat(traj["actions"])
    out["old_logprobs"] = reduce_logprobs(_flat(traj["logprobs"]), level)
    tokens = traj.get("token_mask")
    out["token_mask"] = _flat(torch.ones_like(traj["logprobs"], dtype=torch.bool) if tokens is None else tokens)
    out["forward_inputs"] = {k: _flat(v) for k, v in traj["forward_inputs"].items()}
    if ref_logprobs is not None and not kl_in_reward:
        out["ref_logprobs"] = reduce_logprobs(_flat(ref_logprobs), level)
    return out


def _flat(x: Tensor) -> Tensor:
    """``[T, B, ...]`` -> ``[T * B, ...]``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` on every leaf of a nested dict (trajectories hold ``forward_inputs`` as a dict)."""
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


def tree_cat(trees: list[Mapping[str, Any]], dim: int) -> dict[str, Any]:
    """Concatenate nested dicts of tensors leaf by leaf along ``dim``."""
    first = trees[0]
    return {k: tree_cat([t[k] for t in trees], dim) if isinstance(first[k], Mapping)
            else torch.cat([t[k] for t in trees], dim=dim) for k in first}
