"""The two configurations an OpenVLA-OFT policy is built from.

``VLAConfig`` is what a checkpoint's ``config.json`` says about the graph (Prismatic/OpenVLA
fields), so a 7B checkpoint and a tiny test checkpoint build the same modules with different
sizes. ``PolicyOptions`` is the ``actor.model`` group of our Hydra config.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from transformers import LlamaConfig

from core.errors import ConfigError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ViTSpec:
    """Shape of one timm ViT, as timm builds it for a model id."""

    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float
    class_token: bool
    reg_tokens: int
    no_embed_class: bool  # position embeddings cover patches only (prefix tokens get none)
    layer_scale: bool
    map_pool: bool  # a latent attention-pool head exists (held for checkpoint parity, unused)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


# The backbones OpenVLA checkpoints use, keyed by timm architecture (the part before ".tag").
TIMM_SPECS: dict[str, ViTSpec] = {
    "vit_large_patch14_reg4_dinov2": ViTSpec(
        14, 1024, 24, 16, 4.0, True, 4, True, True, False, IMAGENET_MEAN, IMAGENET_STD
    ),
    "vit_so400m_patch14_siglip_224": ViTSpec(
        14, 1152, 27, 16, 3.7362, False, 0, False, False, True, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    ),
}
# Size fields a checkpoint may override per backbone (``timm_arch_overrides``, our extension):
# this is how a tiny test checkpoint keeps the graph of the real one with small widths.
ARCH_OVERRIDE_KEYS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")


def vit_spec(timm_model_id: str, overrides: Mapping[str, Any] | None, source: str) -> ViTSpec:
    arch = timm_model_id.split(".")[0]
    if arch not in TIMM_SPECS:
        raise ConfigError(
            f"{source}: timm_model_ids entry {timm_model_id!r} is not supported; "
            f"expected one of {sorted(TIMM_SPECS)}"
        )
    spec = TIMM_SPECS[arch]
    if overrides:
        bad = sorted(set(overrides) - set(ARCH_OVERRIDE_KEYS))
        if bad:
            raise ConfigError(
                f"{source}: timm_arch_overrides has unknown keys {bad}; "
                f"expected some of {list(ARCH_OVERRIDE_KEYS)}"
            )
        spec = replace(spec, **dict(overrides))
    if spec.depth < 2:
        raise ConfigError(f"{source}: a ViT needs depth >= 2 (features come from the second-to-last block)")
    return spec


def _require(d: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in d:
        raise ConfigError(f"{source}: missing required key {key!r}")
    return d[key]


@dataclass
class VLAConfig:
    """The graph-defining fields of an OpenVLA ``config.json``; ``raw`` is written back on save."""

    raw: dict[str, Any]
    use_fused_vision_backbone: bool
    image_size: int
    timm_model_ids: list[str]
    vit_specs: list[ViTSpec]
    text_config: LlamaConfig
    pad_to_multiple_of: int
    n_action_bins: int
    norm_stats: dict[str, Any]

    @property
    def tokenizer_vocab_size(self) -> int:
        """The tokenizer's own vocabulary; the LLM's rows beyond it are padding rows."""
        return self.text_config.vocab_size - self.pad_to_multiple_of

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str) -> VLAConfig:
        raw = copy.deepcopy(dict(d))
        fused = bool(_require(raw, "use_fused_vision_backbone", source))
        ids = list(_require(raw, "timm_model_ids", source))
        sizes = list(_require(raw, "image_sizes", source))
        n_backbones = 2 if fused else 1
        if len(ids) != n_backbones or len(sizes) != n_backbones:
            raise ConfigError(
                f"{source}: timm_model_ids and image_sizes need {n_backbones} entries for "
                f"use_fused_vision_backbone={fused}, got {ids} and {sizes}"
            )
        if len(set(sizes)) != 1:
            raise ConfigError(f"{source}: image_sizes must be equal for both backbones, got {sizes}")
        acts = raw.get("timm_override_act_layers") or [None] * n_backbones
        if any(a is not None for a in acts):
            raise ConfigError(f"{source}: timm_override_act_layers {acts} is not supported (expected nulls)")
        strategy = raw.get("image_resize_strategy", "resize-naive")
        if strategy != "resize-naive":
            raise ConfigError(
                f"{source}: image_resize_strategy {strategy!r} is not supported; expected 'resize-naive' "
                "(the strategy OpenVLA checkpoints are trained with)"
            )
        overrides = raw.get("timm_arch_overrides") or [None] * n_backbones
        if len(overrides) != n_backbones:
            raise ConfigError(f"{source}: timm_arch_overrides needs {n_backbones} entries, got {len(overrides)}")
        specs = [vit_spec(i, o, source) for i, o in zip(ids, overrides)]
        text = dict(_require(raw, "text_config", source))
        if text.get("model_type", "llama") != "llama":
            raise ConfigError(
                f"{source}: text_config.model_type {text['model_type']!r} is not supported; expected 'llama'"
            )
        _require(text, "vocab_size", f"{source} text_config")
        text.pop("model_type", None)
        text.pop("torch_dtype", None)
        text_config = LlamaConfig(**text)
        pad = int(_require(raw, "pad_to_multiple_of", source))
        bins = int(raw.get("n_action_bins", 256))
        if text_config.vocab_size - pad <= bins:
            raise ConfigError(f"{source}: text_config.vocab_size - pad_to_multiple_of must exceed n_action_bins={bins}")
        return cls(
            raw=raw,
            use_fused_vision_backbone=fused,
            image_size=int(sizes[0]),
            timm_model_ids=ids,
            vit_specs=specs,
            text_config=text_config,
            pad_to_multiple_of=pad,
            n_action_bins=bins,
            norm_stats=dict(raw.get("norm_stats") or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        out = copy.deepcopy(self.raw)
        out["norm_stats"] = copy.deepcopy(self.norm_stats)
        return out


@dataclass(frozen=True)
class PolicyOptions:
    """The ``actor.model`` keys this policy reads besides the common ones of ``policies.base``
    (defaults live in config/model/openvla_oft.yaml)."""

    model_path: str
    action_head: str
    action_stop_token: bool
    init_log_std: float
    use_proprio: bool
    unnorm_key: str | None
    add_value_head: bool
    value_head_hidden_sizes: tuple[int, ...]
    center_crop: bool
    temperature: float
    top_k: int
    precision: str
    is_lora: bool
    lora_rank: int
    lora_alpha: float
    lora_target_modules: str | tuple[str, ...] | None
    lora_path: str | None
    num_images_in_input: int
    attn_implementation: str
    max_prompt_length: int
    normalize_gripper: bool
    invert_gripper: bool
    vocab_size: int | None
    hidden_size: int | None
    image_size: tuple[int, int] | None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> PolicyOptions:
        values = {}
        for f in fields(cls):
            if f.name not in cfg:
                raise ConfigError(f"actor.model.{f.name} is missing (see config/model/openvla_oft.yaml)")
            values[f.name] = cfg[f.name]
        if not values["model_path"]:
            raise ConfigError("actor.model.model_path is required: an OpenVLA(-OFT) checkpoint folder")
        values["value_head_hidden_sizes"] = tuple(int(x) for x in values["value_head_hidden_sizes"])
        if isinstance(values["lora_target_modules"], Sequence) and not isinstance(values["lora_target_modules"], str):
            values["lora_target_modules"] = tuple(str(x) for x in values["lora_target_modules"])
        if values["image_size"] is not None:
            values["image_size"] = tuple(int(x) for x in values["image_size"])
        options = cls(**values)
        options._validate()
        return options

    def _validate(self) -> None:
        def bad(key: str, expected: str) -> ConfigError:
            return ConfigError(f"actor.model.{key}={getattr(self, key)!r}: expected {expected}")

        # the schema's rules (action_head, precision, lora_alpha, ...) are checked by the config
        # layer (embodied.config.build_policy, embodied.config.validate); here only the combinations
        if not self.is_lora and self.lora_path:
            raise bad("lora_path", "null when is_lora is false")
        if not self.is_lora and self.lora_target_modules is not None:
            raise bad("lora_target_modules", "null when is_lora is false")
