"""Hugging Face Llama / Qwen2 weights <-> Megatron-Core ``GPTModel`` weights, with the
tensor-parallel split and its inverse.

Megatron-Core 0.16.1 ships no converter, so this is the whole mapping. The shapes of a model come
from its checkpoint's ``config.json`` (``Architecture``); the names follow the layer spec:

==============================================  ==================================================
Hugging Face (``model.`` prefix omitted below)  Megatron-Core (local spec)
==============================================  ==================================================
embed_tokens.weight                             embedding.word_embeddings.weight  vocab split  (3)
layers.i.input_layernorm.weight                 decoder.layers.i.input_layernorm.weight
layers.i.self_attn.{q,k,v}_proj.{weight,bias}   decoder.layers.i.self_attention.linear_qkv.*  (1)
layers.i.self_attn.o_proj.weight                decoder.layers.i.self_attention.linear_proj.weight
layers.i.post_attention_layernorm.weight        decoder.layers.i.pre_mlp_layernorm.weight
layers.i.mlp.{gate,up}_proj.weight              decoder.layers.i.mlp.linear_fc1.weight  (2)
layers.i.mlp.down_proj.weight                   decoder.layers.i.mlp.linear_fc2.weight
norm.weight                                     decoder.final_layernorm.weight
lm_head.weight (untied only)                    output_layer.weight               vocab split  (3)
==============================================  ==================================================

(1) One fused matrix in Megatron's per-group order: for each key/value head g, the query heads
    that share it, then k_g, then v_g. A tensor-parallel rank holds whole groups, so the split is
    a contiguous slice of rows (query groups must divide by the TP size).
(2) ``[gate; up]`` stacked; each TP rank holds ``[gate_r; up_r]``, its slice of both halves.
(3) Padded with zero rows to ``padded_vocab_size`` (a multiple of the TP size, as Megatron-LM pads
    its vocabulary) so that every rank holds as many rows; the padding is dropped on the way
    back. Its logits are masked out (``vocab_parallel.mask_padding``), so it never trains.
The TransformerEngine spec fuses the two norms into the next linear layer
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``): ``fused_norms=True``.

Column-parallel layers (QKV, fc1, embedding, output) split along rows, row-parallel ones
(``linear_proj``, ``linear_fc2``) along columns; norms are replicated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from core.errors import ConfigError

FAMILIES = ("llama", "qwen2")  # config.json model_type values with a mapping


@dataclass(frozen=True)
class Architecture:
    """What a GPTModel needs to know of an HF checkpoint (its ``config.json``)."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # Llama 3 rope scaling ("llama3"), None without
    qkv_bias: bool
    tied_embeddings: bool


def read_architecture(model_path: str | Path) -> Architecture:
    """The architecture of the HF folder ``model_path``; ``ConfigError`` naming ``model_type``
    (and the architectures) for a family with no mapping, or naming the feature that has none."""
    path = Path(model_path)
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"actor.model.model_path={str(path)!r} is not a Hugging Face model folder (no config.json)")
    raw = json.loads(file.read_text())
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"actor.model.model_path={str(path)!r}: model_type {family!r} (architectures "
                          f"{raw.get('architectures')}) has no Megatron weight mapping; mapped families: "
                          f"{', '.join(FAMILIES)}")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)  # the family's defaults for keys the file leaves out
    where = f"{file} ({family})"
    if cfg.hidden_act != "silu":
        raise ConfigError(f"{where}: hidden_act {cfg.hidden_act!r} has no Megatron mapping (only silu: SwiGLU)")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ConfigError(f"{where}: attention_bias/mlp_bias have no Megatron mapping (biases on every "
                          "projection; only Qwen2's query/key/value biases map)")
    if getattr(cfg, "use_sliding_window", False):
        raise ConfigError(f"{where}: use_sliding_window has no Megatron mapping (full attention only)")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind == "llama3":
        # Megatron's rope scaling hard-codes Llama 3's low/high frequency factors and context
        # (rotary_pos_embedding.py _apply_scaling: 1, 4, 8192); only the factor is an argument
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if any(float(rope.get(k, -1)) != v for k, v in fixed.items()):
            raise ConfigError(f"{where}: rope_scaling {rope} has no Megatron mapping (Megatron's llama3 scaling "
                              f"fixes {fixed})")
        scaling = float(rope["factor"])
    elif kind != "default":
        raise ConfigError(f"{where}: rope_scaling type {kind!r} has no Megatron mapping (default, llama3)")
    heads = cfg.num_attention_heads
    return Architecture(
        family=family, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings, norm_eps=cfg.rms_norm_eps, rope_theta=float(theta),
        rope_scaling_factor=scaling, qkv_bias=family == "qwen2",
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))


def _names(i: int, fused_norms: bool) -> dict[str, str]:
    """Megatron name of layer ``i``'s tensors, by role."""
    layer = f"decoder.layers.{i}."
    attn, mlp = layer + "self_attention.", layer + "mlp."
    return {
        "input_norm": attn + "linear_qkv.layer_norm_weight" if fused_norms else layer + "input_layernorm.weight",
        "mlp_norm": mlp + "linear_fc1.layer_norm_weight" if fused_norms else layer + "pre_mlp_layernorm.weight",
        "qkv": attn + "linear_qkv.weight", "qkv_bias": attn + "linear_qkv.bias",
        "proj": attn + "linear_proj.weight", "fc1": mlp + "linear_fc1.weight", "fc2": mlp + "linear_fc2.weight",
    }


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: Architecture) -> Tensor:
    """Rows of q, k, v (HF order) -> Megatron's per-group order; works for weights and biases."""
    groups = arch.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)  # the query heads of each group
    k, v = k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, arch: Architecture) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``_fuse_qkv``."""
    d, per_group = arch.head_dim, arch.num_heads // arch.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(arch.num_kv_heads, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The GPTModel's vocabulary: ``vocab_size`` rounded up to a multiple of ``tp_size``, so that
    the vocab-split layers divide evenly (Megatron-LM's ``make_vocab_size_divisible_by`` = 1)."""
    return -(-vocab_size // tp_size) * tp_size


def hf_to_megatron(hf: Mapping[str, Tensor], arch: Architecture, tp_rank: int = 0, tp_size: int = 1,
                   fused_norms: bool = False) -> dict[str, Tensor]:
    """The weights that TP rank ``tp_rank`` of ``tp_size`` holds, from a full HF state dict
    (names as in ``AutoModelForCausalLM.state_dict()``)."""

    def rows(t: Tensor) -> Tensor:  # column-parallel: this rank's slice of rows
        return t.chunk(tp_size, dim=0)[tp_rank]

    def cols(t: Tensor) -> Tensor:  # row-parallel: this rank's slice of columns
        return t.chunk(tp_size, dim=1)[tp_rank]

    def vocab_rows(t: Tensor) -> Tensor:  # vocab-parallel: padded with zero rows, then split
        padding = t.new_zeros(padded_vocab_size(arch.vocab_size, tp_size) - arch.vocab_size, t.shape[1])
        return rows(torch.cat([t, padding]))

    out = {"embedding.word_embeddings.weight": vocab_rows(hf["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not arch.tied_embeddings:
        out["output_layer.weight"] = vocab_rows(hf["lm_head.weight"])
    for i in range(arch.num_layers):
        src, dst = f"model.layers.{i}.", _names(i, fused_norms)
        attn = src + "self_attn."
        out[dst["input_norm"]] = hf[src + "input_layernorm.weight"]
        out[dst["mlp_norm"]] = hf[src + "post_attention_layernorm.weight"]
        out[dst["qkv"]] = rows(_fuse_qkv(*(hf[f"{attn}{p}_proj.weight"] for p in "qkv"), arch))
        if arch.qkv_bias:
            out[dst["qkv_bias"]] = rows(_fuse_qkv(*(hf[f"{attn}{p}_proj.bias"] for p in "qkv"), arch))
        out[dst["proj"]] = cols(hf[attn + "o_proj.weight"])
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst["fc1"]] = torch.cat([rows(gate), rows(up)])
        out[dst["fc2"]] = cols(hf[src + "mlp.down_proj.weight"])
    return out


def megatron_to_hf(shards: Sequence[Mapping[str, Tensor]], arch: Architecture,
                   fused_norms: bool = False) -> dict[str, Tensor]:
    """The full HF state dict from the weights of every TP rank (``shards[r]``: rank r's), with
    ``lm_head.weight`` the embedding itself when the checkpoint ties them (as HF's state dict)
    and the vocabulary's padding rows dropped."""
    first = shards[0]

    def rows(name: str) -> Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def cols(name: str) -> Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    def vocab_rows(name: str) -> Tensor:
        return rows(name)[:arch.vocab_size]

    embed = vocab_rows("embedding.word_embeddings.weight")
    out = {"model.embed_tokens.weight": embed, "model.norm.weight": first["decoder.final_layernorm.weight"],
           "lm_head.weight": embed if arch.tied_embeddings else vocab_rows("output_layer.weight")}
    for i in range(arch.num_layers):
        dst, src = f"model.layers.{i}.", _names(i, fused_norms)
        attn = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = first[src["input_norm"]]
        out[dst + "post_attention_layernorm.weight"] = first[src["mlp_norm"]]
        for p, t in zip("qkv", _split_qkv(rows(src["qkv"]), arch)):
            out[f"{attn}{p}_proj.weight"] = t
        if arch.qkv_bias:
            for p, t in zip("qkv", _split_qkv(rows(src["qkv_bias"]), arch)):
                out[f"{attn}{p}_proj.bias"] = t
        out[attn + "o_proj.weight"] = cols(src["proj"])
        halves = [s[src["fc1"]].chunk(2) for s in shards]  # each rank: [gate_r; up_r]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[dst + "mlp.down_proj.weight"] = cols(src["fc2"])
    return {k: v.contiguous() for k, v in out.items()}
