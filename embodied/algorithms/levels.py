"""How chunked env signals line up with advantages and log-probs.

The env executes ``C = num_action_chunks`` actions per policy call and reports
``rewards / terminations / truncations [T, B, C]`` (dones in the chunk's last slot). The policy
reports log-probs per token ``[N, C, action_dim]``. Two choices connect them:

- ``algorithm.reward_type`` fixes the time step that GAE / GRPO work on:
  ``chunk_level`` sums each chunk's rewards into one step (``[T, B]``; ``gamma`` discounts per
  chunk, the value head predicts one value per chunk); ``action_level`` makes every action its
  own step (``[T * C, B]``, slot ``c`` of chunk ``t`` is step ``t * C + c``; one value per
  action, all predicted from the chunk's observation).
- ``algorithm.logprob_type`` fixes what one importance ratio covers: a token (one action dim),
  an action (sum over its dims) or a whole chunk (sum over all of it).

Advantages ``[T, B]`` or ``[T, B, C]`` are then broadcast over the finer log-prob dims.
Chunk-level ratios with action-level advantages are refused: one ratio for the whole chunk
cannot be paired with a different advantage per action without double counting.
"""

from __future__ import annotations

from torch import Tensor

from core.errors import expected

REWARD_LEVELS = ("chunk_level", "action_level")
LOGPROB_LEVELS = ("token_level", "action_level", "chunk_level")


def check_levels(reward_type: str, logprob_type: str) -> None:
    """Fail early on unknown or incompatible ``algorithm.reward_type`` / ``logprob_type``."""
    for key, value, allowed in (("algorithm.reward_type", reward_type, REWARD_LEVELS),
                                ("algorithm.logprob_type", logprob_type, LOGPROB_LEVELS)):
        if value not in allowed:
            raise expected(key, value, f"one of {list(allowed)}")
    if reward_type == "action_level" and logprob_type == "chunk_level":
        raise ValueError(
            "algorithm.logprob_type chunk_level needs algorithm.reward_type chunk_level "
            "(action_level rewards give one advantage per action)"
        )


def chunks_to_steps(x: Tensor, reward_type: str, reduce: str = "sum") -> Tensor:
    """``[T, B, C]`` chunk signals -> ``[T', B]`` steps of the reward level.

    chunk_level: ``reduce`` over the chunk (``"sum"`` for rewards, ``"any"`` for dones);
    action_level: interleave slots into time, ``T' = T * C``.
    """
    if reward_type == "chunk_level":
        return x.any(dim=-1) if reduce == "any" else x.sum(dim=-1)
    if reward_type == "action_level":
        steps, batch, chunk = x.shape[:3]
        return x.transpose(1, 2).reshape(steps * chunk, batch, *x.shape[3:])
    raise expected("algorithm.reward_type", reward_type, f"one of {list(REWARD_LEVELS)}")


def values_to_steps(values: Tensor, reward_type: str) -> Tensor:
    """Values of ``T + 1`` observations -> ``[T' + 1, B]`` for ``compute_gae``.

    chunk_level: ``[T + 1, B]`` passes through. action_level: ``[T + 1, B, C]`` is interleaved
    and cut after slot 0 of the last observation, the value that bootstraps the final action.
    """
    if reward_type == "chunk_level":
        return values
    steps_plus_one, _, chunk = values.shape
    return chunks_to_steps(values, "action_level")[: (steps_plus_one - 1) * chunk + 1]


def final_values_to_steps(final_values: Tensor, num_action_chunks: int, reward_type: str) -> Tensor:
    """``[T, B]`` values of final observations -> ``[T', B]``, placed on the step where the
    episode ended (a chunk's last slot at action level; other slots are never read)."""
    if reward_type == "chunk_level":
        return final_values
    steps, batch = final_values.shape
    out = final_values.new_zeros(steps, num_action_chunks, batch)
    out[:, -1] = final_values
    return out.reshape(steps * num_action_chunks, batch)


def steps_to_chunks(x: Tensor, num_action_chunks: int, reward_type: str) -> Tensor:
    """Inverse of ``chunks_to_steps`` for per-step results (advantages, returns, masks):
    chunk_level ``[T, B]`` unchanged, action_level ``[T * C, B]`` -> ``[T, B, C]``."""
    if reward_type == "chunk_level":
        return x
    total, batch = x.shape
    return x.reshape(total // num_action_chunks, num_action_chunks, batch).transpose(1, 2)


def reduce_logprobs(logprobs: Tensor, level: str) -> Tensor:
    """Per-token ``[B, C, action_dim]`` -> ``token_level`` (unchanged), ``action_level``
    (``[B, C]``, joint over an action's dims) or ``chunk_level`` (``[B]``, joint over the chunk).
    Tokens are sampled independently given the observation, so joint log-probs are sums (the
    same for entropies, at ``algorithm.entropy_type``)."""
    if level == "token_level":
        return logprobs
    if level == "action_level":
        return logprobs.sum(dim=-1)
    if level == "chunk_level":
        return logprobs.sum(dim=(-2, -1))
    raise expected("algorithm.logprob_type", level, f"one of {list(LOGPROB_LEVELS)}")


def expand_like(x: Tensor, target: Tensor) -> Tensor:
    """Broadcast per-sample ``x`` (``[N]`` or ``[N, C]``) over the trailing dims of ``target``
    (log-probs ``[N]``, ``[N, C]`` or ``[N, C, action_dim]``)."""
    if x.dim() > target.dim():
        raise ValueError(f"cannot align shape {tuple(x.shape)} to log-probs of shape {tuple(target.shape)}")
    return x.reshape(*x.shape, *([1] * (target.dim() - x.dim()))).expand_as(target)
