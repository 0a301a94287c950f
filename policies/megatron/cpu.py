"""Megatron-Core 0.16.1 on a machine without CUDA: its CUDA assumptions on the paths this backend
uses, each handled here and nowhere else.

Upstream allocates some tensors with ``device=torch.cuda.current_device()`` and saves CUDA RNG
state unconditionally, so a CPU-only torch fails with "Torch not compiled with CUDA enabled".
Each adapter below names the upstream lines it covers; all of them act on one model, one
Megatron buffer or one save call (no change to torch itself, no ``Tensor.type`` spoofing), and
the builder applies them only when ``needed()``. Paths this backend does not take on CPU are
avoided instead of adapted:

- full-logit gathers (``tensor_parallel/mappings.py:91``): log-probs and entropy stay
  vocab-parallel (``policies/megatron/vocab_parallel.py``);
- Megatron's DDP buffers and optimizers (``distributed/param_and_grad_buffer.py:783,800,806``,
  ``optimizer/optimizer.py:907``, ``optimizer/clip_grads.py:90,103,115,167``,
  ``optimizer/distrib_optimizer.py:420,431``): the actor uses a plain torch optimizer, with the
  data-parallel all-reduce and the tensor-parallel grad-norm clip of ``training.py``;
- sequence parallelism (``tensor_parallel/mappings.py:141,181``, ``tensor_parallel/layers.py:552``):
  refused without CUDA; pipeline parallelism (``pipeline_parallel/schedules.py:596``,
  ``p2p_communication.py:313,321,398``): refused (``options.py``);
- the default causal mask (``transformer/utils.py:35``, allocated on "cuda" when no mask is
  passed): the policy passes its causal mask explicitly;
- the CUDA RNG tracker (its seeding, ``tensor_parallel/random.py:235``, and its ``fork`` around
  attention dropout, ``transformer/dot_product_attention.py:217``): ``model.init_parallel``
  installs Megatron's inference tracker, whose seeding and ``fork`` do nothing; dropout is 0.

``tests/test_megatron.py`` runs each covered upstream path without its adapter and expects the
known failure, so an upgrade that fixes (or moves) one shows up as a failing test.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

MEGATRON_VERSION = "0.16.1"  # the version whose lines are cited here (pyproject's megatron extra)


def needed() -> bool:
    """Whether the adapters apply: no CUDA device."""
    return not torch.cuda.is_available()


# -- models/common/embeddings/rotary_pos_embedding.py:161-162 ------------------------------------
def _host_rotary_emb(self: nn.Module, max_seq_len: int, offset: int = 0) -> Tensor:
    """``RotaryEmbedding.get_emb`` without its first-call move of ``inv_freq`` to the CUDA
    device (lines 161-162); the rest is upstream's body (lines 164-175)."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def keep_rotary_on_host(rotary: nn.Module) -> None:
    """Give this ``RotaryEmbedding`` (a ``GPTModel``'s ``rotary_pos_emb``) the host ``get_emb``."""
    rotary.get_emb = _host_rotary_emb.__get__(rotary)


# -- core/utils.py:627-632, reached from transformer/dot_product_attention.py:189 ----------------
def host_memory_buffer() -> Any:
    """A ``GlobalMemoryBuffer`` that allocates in host memory (upstream allocates on
    ``torch.cuda.current_device()``, utils.py:631); the attention scores are computed into it."""
    from megatron.core.utils import GlobalMemoryBuffer

    class HostMemoryBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            held = self.buffer.get((name, dtype))
            size = math.prod(tensor_shape)
            if held is None or held.numel() < size:
                self.buffer[(name, dtype)] = torch.empty(size, dtype=dtype)
            return super().get_tensor(tensor_shape, dtype, name, mem_alloc_context)

    return HostMemoryBuffer()


def use_host_memory_buffer() -> None:
    """Replace the buffer that ``parallel_state.initialize_model_parallel`` created
    (``parallel_state._set_global_memory_buffer``) by ``host_memory_buffer()``."""
    from megatron.core import parallel_state

    parallel_state._GLOBAL_MEMORY_BUFFER = host_memory_buffer()


# -- tensor_parallel/random.py:55 (CheckpointFunction saves the CUDA RNG state) -----------------
def recompute_layers(model: nn.Module, granularity: str, method: str | None,
                     num_layers: int | None) -> list[nn.Module]:
    """Activation recompute with ``torch.utils.checkpoint`` instead of Megatron's
    ``CheckpointFunction``, which reads the CUDA RNG state (random.py:55, via
    ``_get_all_rng_states``). Same recomputed parts as upstream: ``full`` recomputes whole layers
    (``block``: the first ``num_layers``; ``uniform``: all of them, each layer its own chunk where
    upstream saves one input per chunk of ``num_layers``: the same numbers, a little more
    memory), ``selective`` the core attention of every layer. Returns the recomputed modules."""
    layers = list(model.decoder.layers)
    if granularity == "selective":
        targets = [layer.self_attention.core_attention for layer in layers]
    else:
        targets = layers[:num_layers] if method == "block" else layers
    for module in targets:
        module.forward = functools.partial(_checkpointed, module.forward)
    return targets


def _checkpointed(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


# -- dist_checkpointing/strategies/filesystem_async.py:229-230 and state_dict_saver.py:251-253 --
def host_save_strategy() -> Any:
    """Megatron's ``torch_dist`` save strategy without its two CUDA calls: tensors are staged
    with blocking copies (upstream stages with ``non_blocking=True`` and then calls
    ``torch.cuda.synchronize()``), and the finalize step broadcasts its failure flag from a host
    tensor (upstream allocates it on ``torch.cuda.current_device()``)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
    )

    class HostSaveStrategy(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
            save_fn, _, save_args = writer.get_save_function_and_args()
            preload = functools.partial(writer.preload_tensors, writer.write_buckets, False) if save_fn else None
            finalize = functools.partial(_finalize_save, *save_state_dict_ret)
            return AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload)

    return HostSaveStrategy("torch_dist", 1)


def _finalize_save(storage_writer: Any, global_metadata: Any, dist_wrapper: Any) -> None:
    """``state_dict_saver.save_state_dict_async_finalize`` (0.16.1) with the failure flag on the host."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.utils import _get_failure_dict

    all_results = dist_wrapper.gather_object(storage_writer.retrieve_write_results())
    failures = {}
    if dist_wrapper.is_coordinator:
        failures = _get_failure_dict(all_results)
        if not failures:
            storage_writer.finish(global_metadata, all_results)
    failed = torch.tensor([int(bool(failures))], dtype=torch.int)
    torch.distributed.broadcast(failed, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
    if failed:
        raise CheckpointException("write", failures)
