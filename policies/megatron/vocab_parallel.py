"""Per-token log-probs and entropy from vocab-parallel logits: each tensor-parallel rank holds
the logits of its slice of the vocabulary (``[..., V / tp]``) and no rank ever holds all of them.
The softmax's normalizer is assembled from per-rank maxima and sums (one all-reduce each).
The vocabulary's padding (``weights.padded_vocab_size``) is masked out first (``mask_padding``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def mask_padding(logits: Tensor, vocab_size: int) -> Tensor:
    """``logits`` with the columns past the real vocabulary (the padding, on the last ranks) set
    to -inf: probability 0 and no gradient, so the softmax is the unpadded model's and the
    padding rows of the embedding and output layer never train."""
    from megatron.core import parallel_state

    width = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * width  # this rank's first vocabulary id
    if first + width <= vocab_size:
        return logits
    padding = torch.arange(first, first + width, device=logits.device) >= vocab_size
    return logits.masked_fill(padding, float("-inf"))


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log_softmax(logits)[token]`` through Megatron's vocab-parallel cross entropy.

    Megatron's cross entropy overwrites ``logits`` in place (cross_entropy.py
    ``calculate_predicted_logits``: ``vocab_parallel_logits -= logits_max``), so ``logits`` must
    not be needed afterwards by anything but this function's backward."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits, tokens)


def entropy(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the whole (sharded) vocabulary, with gradient."""
    from megatron.core import parallel_state

    return _VocabParallelEntropy.apply(logits, parallel_state.get_tensor_model_parallel_group())


class _VocabParallelEntropy(torch.autograd.Function):
    """H = -sum_v p_v log p_v, with dH/dz_v = -p_v (H + log p_v); the backward needs only this
    rank's log-probs and H (no communication), so one ``[..., V / tp]`` tensor is saved. Masked
    columns (-inf) get the lowest finite log-prob: p_v = 0 makes their terms 0, not 0 * -inf."""

    @staticmethod
    def forward(ctx, logits: Tensor, group: dist.ProcessGroup) -> Tensor:
        top = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top
        total = shifted.exp().sum(dim=-1, keepdim=True)
        dist.all_reduce(total, group=group)
        logp = (shifted - total.log()).clamp(min=torch.finfo(logits.dtype).min)
        h = -(logp.exp() * logp).sum(dim=-1)
        dist.all_reduce(h, group=group)
        ctx.save_for_backward(logp, h)
        return h

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        logp, h = ctx.saved_tensors
        return -logp.exp() * (h[..., None] + logp) * grad[..., None], None
