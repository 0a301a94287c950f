"""Checks of the Megatron options against the world size and the checkpoint, cheap enough for
the driver before any worker starts (no Megatron import: only ``config.json`` is read)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from core.errors import ConfigError, expected
from policies.causal_core import check_length
from policies.megatron.weights import read_architecture

# actor.model keys that are TransformerConfig fields of the same name: fused CUDA kernels, passed
# through with CUDA, refused without
CUDA_FUSIONS = ("apply_rope_fusion", "bias_dropout_fusion", "persist_layer_norm", "bias_activation_fusion",
                "gradient_accumulation_fusion")

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
# what every mapped family (Llama, Qwen2) is; the reference's keys must agree with the checkpoint
ARCHITECTURE = {"activation": "swiglu", "normalization": "rmsnorm", "position_embedding_type": "rope"}


def check_options(model_cfg: Mapping[str, Any], world_size: int) -> None:
    """Raise ``ConfigError`` naming the ``actor.model`` key when the Megatron options cannot
    work for this checkpoint on ``world_size`` ranks."""
    cfg = model_cfg
    if not cfg.get("model_path"):
        raise ConfigError("actor.model.model_path is required by actor.training_backend megatron")
    arch = read_architecture(cfg["model_path"])
    if cfg.get("is_lora"):
        raise ConfigError("actor.model.is_lora: not supported with actor.training_backend megatron, because "
                          "Megatron-Core has no LoRA for its tensor-parallel layers (peft wraps torch Linear "
                          "layers); train LoRA with training_backend fsdp")
    tp = cfg.get("tensor_model_parallel_size", 1)
    if not isinstance(tp, int) or tp < 1:
        raise expected("actor.model.tensor_model_parallel_size", tp, "an integer >= 1")
    # the vocabulary need not divide: it is padded to a multiple of tp (weights.padded_vocab_size)
    for what, count in (("the actor's world size", world_size), ("num_attention_heads", arch.num_heads),
                        ("num_key_value_heads", arch.num_kv_heads), ("intermediate_size", arch.ffn_hidden_size)):
        if count % tp:
            source = "" if what.startswith("the actor") else f" of {cfg['model_path']}/config.json"
            raise ConfigError(f"actor.model.tensor_model_parallel_size={tp} does not divide {what}{source} ({count})")
    if cfg.get("pipeline_model_parallel_size", 1) != 1:
        raise ConfigError("actor.model.pipeline_model_parallel_size: not supported, because evaluate() runs the "
                          "whole model on every rank (pipeline stages need Megatron's forward-backward schedule)")
    on_host = not torch.cuda.is_available()
    if cfg.get("sequence_parallel"):
        if tp == 1:
            raise ConfigError("actor.model.sequence_parallel needs actor.model.tensor_model_parallel_size > 1")
        if on_host:
            raise ConfigError("actor.model.sequence_parallel: not supported without CUDA, because Megatron-Core "
                              "0.16.1 allocates its sequence gathers on the CUDA device "
                              "(tensor_parallel/mappings.py:141,181, layers.py:552)")
    _check_recompute(cfg, arch.num_layers)
    for key, value in ARCHITECTURE.items():
        if cfg.get(key, value) != value:
            raise ConfigError(f"actor.model.{key}={cfg[key]!r} disagrees with {cfg['model_path']} "
                              f"({arch.family}: {value}); the architecture comes from its config.json")
    if on_host:
        for key in CUDA_FUSIONS:
            if cfg.get(key):
                raise ConfigError(f"actor.model.{key}: not supported without CUDA, because it selects a fused "
                                  "CUDA kernel")
    prompt, response = cfg.get("max_prompt_length"), cfg.get("action_dim")
    if prompt is not None and response is not None:
        check_length(prompt + response, arch.max_positions, cfg["model_path"])


def _check_recompute(cfg: Mapping[str, Any], num_layers: int) -> None:
    granularity, method = cfg.get("recompute_granularity"), cfg.get("recompute_method")
    count = cfg.get("recompute_num_layers")
    if granularity is not None and cfg.get("gradient_checkpointing"):
        raise ConfigError("actor.model.gradient_checkpointing and actor.model.recompute_granularity both set: "
                          "set one (gradient_checkpointing = recompute_granularity full, method uniform, 1 layer)")
    if granularity is None:
        for key in ("recompute_method", "recompute_num_layers"):
            if cfg.get(key) is not None:
                raise ConfigError(f"actor.model.{key} needs actor.model.recompute_granularity (full)")
        return
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise expected("actor.model.recompute_granularity", granularity, f"one of {RECOMPUTE_GRANULARITIES} or null")
    if granularity == "selective":
        if method is not None or count is not None:
            raise ConfigError("actor.model.recompute_method / recompute_num_layers: only with "
                              "recompute_granularity full (selective recomputes every layer's attention)")
        return
    if method not in RECOMPUTE_METHODS:
        raise expected("actor.model.recompute_method", method, f"one of {RECOMPUTE_METHODS} with recompute_granularity full")
    if not isinstance(count, int) or not 1 <= count <= num_layers:
        raise expected("actor.model.recompute_num_layers", count, f"an integer in [1, {num_layers}] (the model's layers)")

