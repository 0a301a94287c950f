"""From a rollout's time-major ``Trajectory`` to flat training ``Samples`` with advantages.

A trajectory holds ``T`` chunk steps of ``B`` envs (``embodied/batch.py``): env signals per
action ``[T, B, C]``, per-token actions and log-probs ``[T, B, C, A]``, and with a critic the
values of the ``T + 1`` observations. The advantage estimator named by ``algorithm.adv_type``
(``ADVANTAGES``) works at the reward level (``levels.py``); everything is then flattened to
``N = T * B`` samples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from embodied.algorithms.advantages import ADVANTAGES, StepSignals, normalize_advantages
from embodied.algorithms.kl import kl_penalty
from embodied.algorithms.losses import valid_mask
from embodied.algorithms.levels import (
    check_levels,
    chunks_to_steps,
    final_values_to_steps,
    reduce_logprobs,
    steps_to_chunks,
    values_to_steps,
)
from embodied.batch import Samples, Trajectory

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("algorithm.adv_type", "algorithm.bootstrap_at_done", "algorithm.kl_penalty",
               "algorithm.reward_type", "algorithm.normalize_advantages")


def training_samples(traj: Trajectory, algo: Mapping[str, Any], ref_logprobs: Tensor | None = None,
                     proximal: tuple[Tensor, Tensor | None] | None = None) -> Samples:
    """Advantages on the reward level, then ``N = T * B`` samples with ``old_logprobs`` at
    ``logprob_type``, ``advantages`` / ``mask`` (and ``returns`` / ``old_values`` with a critic)
    as ``[N]`` or ``[N, C]``, and ``ref_logprobs`` when the KL goes into the loss.

    ``proximal``: the policy's own per-token log-probs ``[T, B, C, A]`` and values (``[N]`` or
    ``[N, C]``, or None) at the start of the update, for a decoupled loss: they become
    ``proximal_logprobs`` and, with a critic, the ``old_values`` the value clip holds on to.

    With ``bootstrap_at_done: always`` a terminated episode bootstraps from its final
    observation's value like a truncated one. ``ref_logprobs`` (per token, ``[T, B, C, A]``) are
    the reference policy's; with ``use_kl_in_reward`` their KL is subtracted from the rewards
    before the advantages.
    """
    reward_type, level = algo["reward_type"], algo["logprob_type"]
    check_levels(reward_type, level)
    chunks = traj.rewards.shape[2]
    rewards = traj.rewards.float()
    kl_in_reward = ref_logprobs is not None and algo["use_kl_in_reward"] and algo["kl_beta"] > 0
    if kl_in_reward:
        token_kl = kl_penalty(traj.logprobs, ref_logprobs, algo["kl_penalty"])
        rewards = rewards - algo["kl_beta"] * token_kl.sum(dim=-1)
    terminations = chunks_to_steps(traj.terminations.bool(), reward_type, "any")
    truncations = chunks_to_steps(traj.truncations.bool(), reward_type, "any")
    if algo["bootstrap_at_done"] == "always":
        # every episode end bootstraps, as if cut by a time limit (see config/base.yaml)
        terminations, truncations = torch.zeros_like(terminations), terminations | truncations
    steps = StepSignals(chunks_to_steps(rewards, reward_type), terminations, truncations)
    if traj.values is not None:
        steps.values = values_to_steps(traj.values.float(), reward_type)
    if traj.final_values is not None:
        steps.final_values = final_values_to_steps(traj.final_values.float(), chunks, reward_type)
    estimate = ADVANTAGES.get(algo["adv_type"])(steps, algo)

    def per_sample(x: Tensor) -> Tensor:  # reward-level [T', B] -> [N(, C)]
        return steps_to_chunks(x, chunks, reward_type).flatten(0, 1)

    flat = traj.map(lambda x: x.flatten(0, 1))
    samples = Samples(
        forward_inputs=flat.forward_inputs, actions=flat.actions,
        old_logprobs=reduce_logprobs(flat.logprobs, level), advantages=per_sample(estimate.advantages),
        mask=per_sample(estimate.mask), token_mask=flat.token_mask,
    )
    if estimate.returns is not None:
        samples.returns = per_sample(estimate.returns)
        samples.old_values = per_sample(steps.values[:-1])
    if ref_logprobs is not None and not kl_in_reward:
        samples.ref_logprobs = reduce_logprobs(ref_logprobs.flatten(0, 1), level)
    if proximal is not None:
        logprobs, values = proximal
        samples.proximal_logprobs = reduce_logprobs(logprobs.flatten(0, 1), level)
        if samples.returns is not None:
            samples.old_values = values
    return samples


def truncated_is_weights(logprobs: Tensor, rollout_logprobs: Tensor, level: str, clip: float) -> Tensor:
    """``algorithm.importance_sampling_fix``: ``min(pi_old / pi_rollout, clip)`` per sample at the
    log-prob ``level`` (``[N]``, ``[N, C]`` or ``[N, C, A]``), from per-token ``[T, B, C, A]``
    log-probs of the actor (recomputed) and of the rollout engine that sampled. The policy loss's
    advantages are multiplied by it: the tokens the engine over-sampled relative to the actor's
    own distribution weigh less (truncated importance sampling; RLinf's importance_sampling_fix)."""
    return reduce_logprobs((logprobs - rollout_logprobs).flatten(0, 1), level).exp().clamp(max=clip)


def is_weight_metrics(samples: Samples, clip: float) -> dict[str, float]:
    """The mean truncated weight over the valid entries, and the fraction the truncation cut."""
    weights = samples.is_weights
    valid = valid_mask(samples.mask, samples.token_mask, weights)
    count = valid.sum().clamp(min=1)
    return {"actor/is_weight": float((weights * valid).sum() / count),
            "actor/is_truncated_fraction": float(((weights >= clip) & valid).sum() / count)}


def normalize(samples: Samples, algo: Mapping[str, Any], all_reduce: Callable[[Tensor], Any] | None) -> Samples:
    """``algorithm.normalize_advantages``: whiten the advantages over the whole global batch (all
    ranks, valid samples only, the population's std) where the estimator declares it (GAE).
    GRPO's are already normalized within their groups: whitening them again over the batch
    would rescale every group by the batch's spread."""
    if algo["normalize_advantages"] and ADVANTAGES.declared(algo["adv_type"])["normalize"]:
        samples.advantages = normalize_advantages(samples.advantages, samples.mask, correction=0,
                                                  all_reduce=all_reduce)
    return samples
