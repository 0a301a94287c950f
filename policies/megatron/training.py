"""What an actor needs to train a Megatron model with a plain torch optimizer, in place of what
FSDP2 gives it: which samples a rank trains on, the data-parallel gradient all-reduce, and a
gradient-norm clip that counts tensor-parallel shards once.

Call order of one optimizer step (every rank)::

    optimizer.zero_grad(set_to_none=True)
    for micro_batch in this data-parallel rank's minibatch:   # same samples on every TP rank
        (loss / number_of_micro_batches).backward()
    reduce_gradients(model)                                   # once, after the last backward
    norm = clip_grad_norm(model.parameters(), max_norm)       # same value on every rank
    if math.isfinite(norm):
        optimizer.step()

The ranks of one tensor-parallel group compute one model on the same samples: they must get
identical micro-batches (``data_parallel_rank`` picks the share, ``share_across_tensor_parallel``
hands TP rank 0's batch to the others). Losses are replicated across TP, not averaged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

BUCKET_ELEMENTS = 1 << 24  # gradients are all-reduced in flat buckets of at most this many values


def data_parallel_rank() -> int:
    """This rank's index among the data-parallel replicas (which share of a batch it trains on)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def data_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def share_across_tensor_parallel(obj: Any) -> Any:
    """``obj`` as TP rank 0 of this rank's tensor-parallel group holds it (pickled broadcast)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=parallel_state.get_tensor_model_parallel_src_rank(),
                               group=parallel_state.get_tensor_model_parallel_group())
    return box[0]


@torch.no_grad()
def reduce_gradients(model: nn.Module) -> None:
    """Average gradients over the data-parallel replicas; with sequence parallelism also sum the
    gradients of the parameters replicated across TP whose inputs were sequence-sharded (norms),
    as Megatron's ``finalize_model_grads`` does."""
    from megatron.core import parallel_state

    params = [p for p in model.parameters() if p.grad is not None]
    if getattr(model.config, "sequence_parallel", False):
        _all_reduce([p.grad for p in params if getattr(p, "sequence_parallel", False)],
                    parallel_state.get_tensor_model_parallel_group())
    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1:
        grads = [p.grad for p in params]
        _all_reduce(grads, parallel_state.get_data_parallel_group())
        torch._foreach_div_(grads, float(dp))


def _all_reduce(tensors: list[Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` over ``group`` in place, one message per flat bucket (not per tensor)."""
    for bucket in buckets(tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))


def buckets(tensors: list[Tensor]):
    """Consecutive runs of ``tensors`` of one dtype and at most ``BUCKET_ELEMENTS`` values."""
    bucket: list[Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (size + t.numel() > BUCKET_ELEMENTS or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


@torch.no_grad()
def clip_grad_norm(params: list[Tensor], max_norm: float, sharded: bool = False) -> float:
    """Scale gradients so that their global L2 norm is at most ``max_norm``; returns the norm
    before clipping (non-finite when a gradient is: then nothing is scaled and the actor skips
    the step). Tensor-parallel shards count once each, parameters replicated across TP (norms)
    once in all; call after ``reduce_gradients``, when the replicas agree. ``sharded``: ``params``
    are this replica's share (the distributed optimizer's): the norm adds up every replica's."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    squares = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
    for g in counted:
        squares += g.double().pow(2).sum()
    dist.all_reduce(squares, group=None if sharded else parallel_state.get_tensor_model_parallel_group())
    norm = float(squares.sqrt())
    scale = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
    if scale < 1.0:  # False for a non-finite norm
        torch._foreach_mul_(grads, scale)
    return norm


class WrappedOptimizer:
    """What a wrapper of a torch optimizer (``inner``) shows the trainer as its own: the parameter
    groups (whose rates the trainer sets) and the per-parameter state (which offloading moves)."""

    inner: Any

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:
        return self.inner.state
