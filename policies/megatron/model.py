"""Building a Megatron-Core ``GPTModel`` from a Hugging Face checkpoint folder: Megatron's
process groups (tensor parallel over consecutive ranks, data parallel over the rest), the layer
spec (TransformerEngine's when CUDA and TransformerEngine are present, else Megatron's local
modules), the ``TransformerConfig`` from ``config.json`` and the ``actor.model`` options, the
weights through ``weights.hf_to_megatron``, and on a CPU-only machine the adapters of ``cpu.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core.errors import ConfigError
from policies.megatron import cpu
from policies.megatron.options import CUDA_FUSIONS
from policies.megatron.weights import (
    Architecture,
    hf_to_megatron,
    padded_vocab_size,
    read_architecture,
)
from policies.weights import DTYPES


@dataclass(frozen=True)
class MegatronOptions:
    """The ``actor.model`` options the builder reads (see ``policies/megatron/__init__.py``)."""

    tensor_parallel: int = 1
    sequence_parallel: bool = False
    precision: str = "fp32"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_softmax_in_fp32: bool = True
    use_cpu_initialization: bool = False
    seq_length: int | None = None
    fusions: tuple[str, ...] = ()  # the CUDA_FUSIONS that are on

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> MegatronOptions:
        return cls(tensor_parallel=int(cfg.get("tensor_model_parallel_size") or 1),
                   sequence_parallel=bool(cfg.get("sequence_parallel", False)),
                   precision=cfg.get("precision") or "fp32",
                   recompute_granularity=cfg.get("recompute_granularity"),
                   recompute_method=cfg.get("recompute_method"),
                   recompute_num_layers=cfg.get("recompute_num_layers"),
                   attention_softmax_in_fp32=bool(cfg.get("attention_softmax_in_fp32", True)),
                   use_cpu_initialization=bool(cfg.get("use_cpu_initialization", False)),
                   seq_length=cfg.get("seq_length"),
                   fusions=tuple(k for k in CUDA_FUSIONS if cfg.get(k)))


def init_parallel(tensor_parallel: int) -> None:
    """Megatron's process groups over the default group (a one-process gloo group is started
    when there is none, e.g. for an export): TP groups of consecutive ranks, DP over the rest.
    The groups are process-wide, so every model of a process shares one TP size."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tensor_parallel:
            raise ConfigError(f"actor.model.tensor_model_parallel_size={tensor_parallel}: this process already "
                              f"runs Megatron with tensor parallel size {have}")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    # dropout is off, so the RNG tracker's fork() need not switch CUDA RNG states (cpu.py)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if cpu.needed():
        cpu.use_host_memory_buffer()


def transformer_engine_available() -> bool:
    """Whether the TransformerEngine layer spec can be used (CUDA and TransformerEngine)."""
    if not torch.cuda.is_available():
        return False
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE


def build_gpt(arch: Architecture, options: MegatronOptions) -> nn.Module:
    """A ``GPTModel`` of ``arch``'s shapes with random weights (``load_hf_weights`` replaces them).
    The random initialization is kept although it is overwritten: it is also where Megatron marks
    the tensor-parallel parameters (``tensor_model_parallel``, read by the grad-norm clip), and
    ``perform_initialization=False`` skips that too (tensor_parallel/layers.py:244,855,1178)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig

    on_host = cpu.needed()
    dtype = DTYPES[options.precision]
    # on CPU, Megatron's own recompute reads CUDA RNG state; cpu.recompute_layers does it instead
    recompute = {} if on_host else {"recompute_granularity": options.recompute_granularity,
                                    "recompute_method": options.recompute_method,
                                    "recompute_num_layers": options.recompute_num_layers}
    config = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=options.tensor_parallel, sequence_parallel=options.sequence_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=options.attention_softmax_in_fp32,
        use_cpu_initialization=on_host or options.use_cpu_initialization, perform_initialization=True,
        masked_softmax_fusion=not on_host, **{k: k in options.fusions for k in CUDA_FUSIONS}, **recompute)
    fused = transformer_engine_available()
    spec = (get_gpt_layer_with_transformer_engine_spec() if fused
            else get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(
        config, spec, vocab_size=padded_vocab_size(arch.vocab_size, options.tensor_parallel),
        max_sequence_length=options.seq_length or arch.max_positions,
        parallel_output=True, share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope", rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None, rope_scaling_factor=arch.rope_scaling_factor or 8.0)
    model.uses_fused_norms = fused  # the TransformerEngine spec's weight names (weights.py)
    model.to(dtype)  # the norms are built in fp32 whatever params_dtype; Megatron-LM casts them too (Float16Module)
    if on_host:
        cpu.keep_rotary_on_host(model.rotary_pos_emb)
        if options.recompute_granularity:
            cpu.recompute_layers(model, options.recompute_granularity, options.recompute_method,
                                 options.recompute_num_layers)
    if torch.cuda.is_available():
        model.cuda()
    return model


def recompute_every_layer(model: nn.Module) -> list[nn.Module]:
    """Turn on full activation recompute of every decoder layer of a built model (uniform, one
    layer per chunk: what HF's gradient checkpointing does); returns the layers."""
    if cpu.needed():
        return cpu.recompute_layers(model, "full", "uniform", 1)
    # TransformerBlock.forward reads these at every call (transformer_block.py:735)
    model.config.recompute_granularity, model.config.recompute_method = "full", "uniform"
    model.config.recompute_num_layers = 1
    return list(model.decoder.layers)


@torch.no_grad()
def load_megatron_state(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` (this rank's Megatron-named tensors) into ``model``'s parameters; the
    names and shapes must match exactly."""
    from policies.weights import check_keys

    params = dict(model.named_parameters())
    check_keys({k: tuple(p.shape) for k, p in params.items()}, {k: tuple(v.shape) for k, v in state.items()}, source)
    for name, p in params.items():
        p.copy_(state[name])


def load_hf_weights(model: nn.Module, model_path: str | Path, arch: Architecture) -> None:
    """This TP rank's share of the HF checkpoint's weights, mapped to Megatron's names."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto", low_cpu_mem_usage=True).state_dict()
    local = hf_to_megatron(hf, arch, parallel_state.get_tensor_model_parallel_rank(),
                           parallel_state.get_tensor_model_parallel_world_size(), model.uses_fused_norms)
    load_megatron_state(model, local, f"the weights of {model_path} mapped to Megatron")


def build_from_hf(model_path: str | Path, options: MegatronOptions) -> tuple[nn.Module, Architecture]:
    """Process groups, model and weights of the HF folder ``model_path``."""
    arch = read_architecture(model_path)
    init_parallel(options.tensor_parallel)
    model = build_gpt(arch, options)
    load_hf_weights(model, model_path, arch)
    return model, arch
