"""PPO / GRPO losses: clipped policy loss (with dual clip), clipped value loss, entropy bonus,
KL penalty, and the masked aggregation that turns per-token losses into one number.

Policy losses register themselves by ``algorithm.loss_type`` (``POLICY_LOSSES``): a new one is a
function of ``(logprobs, old_logprobs, advantages, mask, *, clip_ratio_low, clip_ratio_high,
clip_ratio_c, loss_agg_func)`` returning ``(loss, metrics)``, decorated here, plus its name in
config/base.yaml's choice list. A loss that declares ``proximal=True`` also takes
``proximal_logprobs`` (the policy's own at the start of the update, which the actor then
computes) and ``behave_weight_threshold``. A loss's ``reads`` are the keys that choosing it makes
the run read: a loss on rollouts reads ``ROLLOUT_UPDATE`` (the actor's update and the advantage
estimator, whose own keys ``ADVANTAGES`` declares); the others are refused under it when set.

Shapes: dim 0 indexes samples ("sequences": one chunk step of one env, or one text response);
any further dims are that sample's tokens. Masks are bool/0-1 tensors of the loss's shape and
drop padding or the stale steps after an episode ended. Metrics are detached 0-dim tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from core.errors import expected
from core.registry import Registry
from embodied.algorithms.kl import kl_penalty
from embodied.algorithms.levels import expand_like

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = Registry("policy loss", "algorithm.loss_type",
                         proximal=False,  # needs the proximal policy's log-probs (and values) at update start
                         imitation=False)  # trains on demonstrations, not rollouts (embodied/algorithms/imitation.py)

# what an update on rollouts reads, whichever loss drives it (embodied/workers/actor.py, trajectory.py)
ROLLOUT_UPDATE = {
    "algorithm.adv_type": "the advantage estimator",
    "algorithm.ratio_clip_eps": "the ratio clip", "algorithm.clip_ratio_low": "the ratio clip below 1",
    "algorithm.clip_ratio_high": "the ratio clip above 1", "algorithm.clip_ratio_c": "the dual clip",
    "algorithm.loss_agg_func": "how token losses aggregate", "algorithm.early_stop_imp_ratio": "a batch's stop",
    "algorithm.entropy_bonus": "the entropy bonus", "algorithm.calculate_entropy": "the entropy metric",
    "algorithm.entropy_type": "the entropy's level", "algorithm.logprob_type": "the log-probs' level",
    "algorithm.reward_type": "the rewards' level",
    "algorithm.kl_beta": "the KL weight", "algorithm.kl_penalty_type": "the KL estimator in the loss",
    "algorithm.kl_penalty": "the KL estimator in the reward", "algorithm.use_kl_in_reward": "KL in the reward",
    "algorithm.target_kl": "an update's stop", "algorithm.rollout_epoch": "rollouts per step",
    "algorithm.update_epochs": "passes over a step's samples", "algorithm.shuffle_rollout": "minibatch order",
    "algorithm.use_valid_token_scale": "micro-batches weighed by their valid tokens",
    "algorithm.staleness_threshold": "rollouts ahead of the update",
    "rollout.recompute_logprobs": "the actor's log-probs of a rollout",
    "algorithm.importance_sampling_fix": "the rollout engine's importance weights",
    "algorithm.importance_sampling_clip": "their truncation",
    "actor.optim.value_lr": "the critic's learning rate",
}

# bound of |log pi - log pi_old| before exp: a ratio stays finite however far the policy moved
MAX_LOG_RATIO = 20.0


def aggregate_loss(loss: Tensor, mask: Tensor | None, loss_agg_func: str) -> Tensor:
    """Reduce a per-token loss to a scalar.

    - ``token-mean``: mean over all valid tokens (every token weighs the same);
    - ``seq-mean-token-sum``: sum each sample's valid tokens, mean over samples;
    - ``seq-mean-token-mean``: mean each sample's valid tokens, mean over samples (every
      sample weighs the same, whatever its length);
    - ``seq-mean-token-sum-norm``: sum each sample's valid tokens, divided by the number of
      token slots per sample (the response horizon, a constant), mean over samples: Dr. GRPO's
      length-unbiased normalization (veRL's ``agg_loss`` sums over the batch instead of
      averaging, which differs by the constant batch size).

    Samples without a valid token are left out of the sample mean; an all-masked batch gives 0
    (still attached to the graph, so distributed backward passes stay in step).
    """
    if loss_agg_func not in AGGREGATIONS:
        raise expected("algorithm.loss_agg_func", loss_agg_func, f"one of {list(AGGREGATIONS)}")
    mask = torch.ones_like(loss) if mask is None else mask.to(loss.dtype)
    if loss_agg_func == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_agg_func == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (loss[0].numel() * loss.shape[0])
    per_sample = (loss * mask).reshape(loss.shape[0], -1).sum(dim=1)
    tokens = mask.reshape(loss.shape[0], -1).sum(dim=1)
    if loss_agg_func == "seq-mean-token-mean":
        per_sample = per_sample / tokens.clamp(min=1.0)
    has_tokens = (tokens > 0).to(loss.dtype)
    return (per_sample * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def valid_token_weights(tokens: Tensor, total: Tensor, data_parallel_size: int) -> Tensor:
    """``algorithm.use_valid_token_scale``: the factor of each micro-batch's (token-mean) loss, given
    its valid ``tokens`` and the ``total`` of the optimizer step on all data-parallel ranks, so that
    the step (micro-batch losses averaged, then gradients averaged over the ranks) descends the
    mean over every valid token of the step: ``tokens x micro-batches x ranks / total``."""
    return tokens * tokens.numel() * data_parallel_size / total.clamp(min=1)


def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    return aggregate_loss(x, mask, "token-mean")


@POLICY_LOSSES.register("ppo", reads=ROLLOUT_UPDATE)
def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    loss_agg_func: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss of PPO, all inputs of one shape.

    ``ratio = pi / pi_old`` (the log-ratio clamped to +-20 first, as veRL does); the loss is ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``,
    i.e. the pessimistic side of the clipped objective. Dual clip (``clip_ratio_c``, > 1) also
    bounds the loss of negative advantages by ``-A * c``: without it a sample whose ratio has
    grown far past 1 while its advantage is negative gives an unbounded loss and gradient.
    """
    loss, clip_metrics = _clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_ratio_low,
                                            clip_ratio_high, clip_ratio_c)
    policy_loss = aggregate_loss(loss, mask, loss_agg_func)
    return policy_loss, {"actor/policy_loss": policy_loss.detach(), **clip_metrics}


def _clipped_surrogate(logprobs: Tensor, reference_logprobs: Tensor, advantages: Tensor, mask: Tensor | None,
                       clip_ratio_low: float, clip_ratio_high: float,
                       clip_ratio_c: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sample ``max(-A r, -A clip(r, 1 - low, 1 + high))``, dual-clipped, with
    ``r = pi / pi_ref``, and its clip metrics: the one piece PPO and decoupled PPO share."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"algorithm.clip_ratio_c must be > 1 (or null to disable dual clip), got {clip_ratio_c}")
    log_ratio = (logprobs - reference_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    with torch.no_grad():
        metrics = {
            # fraction of tokens whose gradient the clip removed
            "actor/clip_fraction": _masked_mean((clipped > unclipped).to(loss.dtype), mask),
            "actor/dual_clip_fraction": _masked_mean(dual_clipped.to(loss.dtype), mask),
            # KL(pi_ref || pi) by the k3 estimator on samples of pi_ref
            "actor/approx_kl": _masked_mean((ratio - 1.0) - log_ratio, mask),
            "actor/ratio": _masked_mean(ratio, mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("decoupled_actor_critic", proximal=True, reads={
    **ROLLOUT_UPDATE, "algorithm.behave_weight_threshold": "the staleness weight's cap"})
def decoupled_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    *,
    proximal_logprobs: Tensor,
    behave_weight_threshold: float | None,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    loss_agg_func: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"), for
    samples from an older policy than the one being trained (asynchronous rollouts):

    - the PPO clip acts on ``pi / pi_prox``, the current policy against the proximal one (the
      weights at the start of this update), so each update moves the policy as far as PPO's;
    - each sample is weighted by ``w = pi_prox / pi_behav``, the proximal policy against the one
      that acted (``old_logprobs``), which corrects for the data's staleness; samples with
      ``w > behave_weight_threshold`` (when set) weigh 0, so a few very stale samples cannot
      dominate.

    The per-sample loss is ``w * max(-A r, -A clip(r, 1 - low, 1 + high))`` (dual-clipped like
    ``ppo_policy_loss``), aggregated over ``mask``; with ``proximal_logprobs == old_logprobs``
    (fresh samples) it is ``ppo_policy_loss`` exactly.
    """
    loss, clip_metrics = _clipped_surrogate(logprobs, proximal_logprobs, advantages, mask, clip_ratio_low,
                                            clip_ratio_high, clip_ratio_c)
    weight = torch.exp((proximal_logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    kept = torch.ones_like(weight, dtype=torch.bool) if behave_weight_threshold is None \
        else weight <= behave_weight_threshold
    policy_loss = aggregate_loss(loss * torch.where(kept, weight, torch.zeros_like(weight)), mask, loss_agg_func)
    with torch.no_grad():
        metrics = {
            "actor/policy_loss": policy_loss.detach(),
            **clip_metrics,
            "actor/behave_weight": _masked_mean(weight, mask),
            "actor/behave_filtered_fraction": _masked_mean((~kept).to(loss.dtype), mask),
        }
    return policy_loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor | None,
    *,
    value_clip: float | None,
    huber_delta: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``0.5 * (V - R)^2`` over valid entries, or with ``huber_delta`` Huber's loss (the same
    inside ``|V - R| <= huber_delta``, linear outside, so that a few far-off returns do not
    dominate the critic's gradient); with ``value_clip`` the new value may move at most that far
    from the rollout's value before the loss stops rewarding it (the pessimistic max of clipped
    and unclipped errors, as in the PPO paper's code)."""
    def error(v: Tensor) -> Tensor:
        if huber_delta is None:
            return 0.5 * (v - returns).square()
        return torch.nn.functional.huber_loss(v, returns, reduction="none", delta=huber_delta)

    loss = error(values)
    clip_fraction = torch.zeros((), device=values.device)
    if value_clip is not None:
        clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        loss = torch.maximum(loss, error(clipped_values))
        clip_fraction = _masked_mean(((values - old_values).abs() > value_clip).to(values.dtype), mask)
    value_loss_ = _masked_mean(loss, mask)
    with torch.no_grad():
        returns_var = _masked_mean((returns - _masked_mean(returns, mask)).square(), mask)
        errors = returns - values
        error_var = _masked_mean((errors - _masked_mean(errors, mask)).square(), mask)
        metrics = {
            "critic/value_loss": value_loss_.detach(),
            "critic/value_clip_fraction": clip_fraction.detach(),
            # 1: values explain returns perfectly; <= 0: no better than a constant
            "critic/explained_variance": 1.0 - error_var / returns_var.clamp(min=1e-8),
        }
    return value_loss_, metrics


def actor_critic_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    token_mask: Tensor | None = None,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    loss_agg_func: str,
    entropy: Tensor | None,
    entropy_bonus: float,
    values: Tensor | None,
    old_values: Tensor | None,
    returns: Tensor | None,
    value_clip: float | None,
    huber_delta: float | None = None,
    value_loss_coef: float,
    ref_logprobs: Tensor | None,
    kl_beta: float,
    kl_penalty_type: str,
    early_stop_imp_ratio: float | None,
    policy_loss: Callable[..., tuple[Tensor, dict[str, Tensor]]] = ppo_policy_loss,
    proximal_logprobs: Tensor | None = None,
    behave_weight_threshold: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one micro-batch:
    ``policy_loss + value_loss_coef * value_loss - entropy_bonus * entropy + kl_beta * kl``,
    the policy loss being one of ``POLICY_LOSSES`` (``algorithm.loss_type``).

    ``logprobs`` / ``old_logprobs`` / ``entropy`` / ``ref_logprobs`` are at the log-prob level
    (``[N]``, ``[N, C]`` or ``[N, C, action_dim]``); ``advantages``, ``mask``, ``values``,
    ``old_values`` and ``returns`` are per sample at the reward level (``[N]`` or ``[N, C]``)
    and are broadcast over the finer log-prob dims. ``token_mask`` (per token, ``[N, C, A]``,
    None = all valid) drops tokens that were never generated (padding of variable-length
    actions) from every term. Pass ``values=None`` for critic-free GRPO and
    ``ref_logprobs=None`` for no KL term; ``proximal_logprobs`` (and ``behave_weight_threshold``)
    go to a policy loss that declares ``proximal`` (its ``old_values`` are then the proximal ones).

    ``early_stop_imp_ratio``: when the mean importance ratio of the micro-batch exceeds it, the
    policy has drifted so far from the one that collected the data that the batch is abandoned:
    the loss is multiplied by 0 (not skipped, so data-parallel ranks still run the same
    backward and gradient all-reduce) and ``actor/early_stopped`` reports 1.
    """
    loss_mask = valid_mask(mask, token_mask, logprobs)
    proximal = {} if proximal_logprobs is None else {"proximal_logprobs": proximal_logprobs,
                                                     "behave_weight_threshold": behave_weight_threshold}
    loss, metrics = policy_loss(
        logprobs,
        old_logprobs,
        expand_like(advantages, logprobs),
        loss_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_func=loss_agg_func,
        **proximal,
    )
    if values is not None:
        critic_loss, critic_metrics = value_loss(values, old_values, returns, mask, value_clip=value_clip,
                                                 huber_delta=huber_delta)
        loss = loss + value_loss_coef * critic_loss
        metrics.update(critic_metrics)
    if entropy is not None:
        entropy_mask = valid_mask(mask, token_mask, entropy)
        mean_entropy = aggregate_loss(entropy, entropy_mask, loss_agg_func)
        loss = loss - entropy_bonus * mean_entropy
        metrics["actor/entropy"] = mean_entropy.detach()
    if ref_logprobs is not None:
        kl = aggregate_loss(kl_penalty(logprobs, ref_logprobs, kl_penalty_type), loss_mask, loss_agg_func)
        loss = loss + kl_beta * kl
        metrics["actor/kl"] = kl.detach()

    stop = early_stop_imp_ratio is not None and bool(metrics["actor/ratio"] > early_stop_imp_ratio)
    if stop:
        loss = loss * 0.0
    metrics["actor/early_stopped"] = torch.tensor(float(stop), device=loss.device)
    metrics["actor/total_loss"] = loss.detach()
    return loss, metrics


def valid_mask(mask: Tensor | None, token_mask: Tensor | None, target: Tensor) -> Tensor | None:
    """The per-sample ``mask`` broadcast over ``target``'s dims, and-ed with ``token_mask`` brought
    to ``target``'s level (a log-prob or entropy summed over tokens counts if any token does)."""
    out = None if mask is None else expand_like(mask, target).bool()
    if token_mask is not None:
        while token_mask.dim() > target.dim():
            token_mask = token_mask.any(dim=-1)
        out = token_mask.bool() if out is None else out & token_mask.bool()
    return out


_LOSS_KEYS = (
    "loss_agg_func", "clip_ratio_c", "entropy_bonus", "value_clip", "huber_delta", "value_loss_coef",
    "kl_beta", "kl_penalty_type", "early_stop_imp_ratio",
)


def loss_hyperparameters(algorithm_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters of ``actor_critic_loss`` from the ``algorithm`` config.

    ``clip_ratio_low`` / ``clip_ratio_high`` fall back to ``ratio_clip_eps`` when unset (null),
    so one key gives symmetric clipping and the two others make it asymmetric. A proximal loss
    (``algorithm.loss_type``) also gets ``behave_weight_threshold``.
    """
    keys = ("loss_type", "ratio_clip_eps", *_LOSS_KEYS)
    missing = [k for k in keys if k not in algorithm_cfg]
    if missing:
        raise KeyError(f"algorithm config lacks {', '.join('algorithm.' + k for k in missing)}")
    eps = algorithm_cfg["ratio_clip_eps"]
    out = {k: algorithm_cfg[k] for k in _LOSS_KEYS}
    if POLICY_LOSSES.declared(algorithm_cfg["loss_type"])["proximal"]:
        out["behave_weight_threshold"] = algorithm_cfg["behave_weight_threshold"]
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = algorithm_cfg.get(key)
        out[key] = eps if value is None else value
    return out
