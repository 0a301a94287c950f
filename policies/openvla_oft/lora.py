"""LoRA for RL fine-tuning, and the small state dict that carries it from actor to rollout.

Adapters go on every linear layer that does work: the Llama attention and MLP projections, the
vision projector and the ViT attention/MLP layers of the blocks that run (OFT fine-tunes
"all-linear" much the same way; the LM head, the unused SigLIP pooling head and last ViT blocks,
and the proprio projector stay frozen). Alpha follows
OFT's ``min(rank, 16)``. Adapters are saved and read in peft's folder format, so an OFT LoRA
checkpoint (``lora_path``) loads, strictly: any adapter tensor without a home is an error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from policies.openvla_oft.checkpoint import CheckpointError, check_keys, full_tensor, is_writer
from policies.openvla_oft.config import ConfigError
from policies.openvla_oft.model import OpenVLAOFT

ADAPTER_DIR = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Everything the actor trains and the rollout needs after an update: adapters and value head.
VALUE_HEAD_PREFIX = "value_head."


def target_modules(model: OpenVLAOFT) -> str:
    """peft's target regex: LLM projections, projector, and ViT blocks except each backbone's
    last (never run: features come from the second-to-last block)."""
    backbone = model.vision_backbone
    vits = [
        rf"vision_backbone\.{name}\.blocks\.(?!{len(vit.blocks) - 1}\.)\d+\.(attn\.(qkv|proj)|mlp\.fc[12])"
        for name, vit in (("featurizer", backbone.featurizer), ("fused_featurizer", backbone.fused_featurizer))
        if vit is not None
    ]
    llm = r"language_model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
    return "(" + "|".join([llm, r"projector\.fc\d", *vits]) + ")"


def apply_lora(model: OpenVLAOFT, rank: int, lora_path: str | Path | None = None) -> PeftModel:
    """Wrap ``model`` with trainable LoRA adapters (fresh, or read from ``lora_path``); the base
    weights are frozen."""
    if lora_path is None:
        config = LoraConfig(
            r=rank,
            lora_alpha=min(rank, 16),
            lora_dropout=0.0,
            target_modules=target_modules(model),
            init_lora_weights="gaussian",
        )
        return get_peft_model(model, config)
    path = Path(lora_path)
    if not (path / ADAPTER_CONFIG).exists() or not (path / ADAPTER_WEIGHTS).exists():
        raise CheckpointError(f"actor.model.lora_path={str(path)!r} needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = LoraConfig.from_pretrained(str(path))
    if config.r != rank:
        raise ConfigError(f"actor.model.lora_rank={rank} but the adapter at {path} has rank {config.r}")
    config.inference_mode = False
    peft_model = get_peft_model(model, config)
    adapter = load_file(str(path / ADAPTER_WEIGHTS))
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    check_keys(expected, {k: tuple(v.shape) for k, v in adapter.items()}, f"LoRA adapter {path / ADAPTER_WEIGHTS}")
    set_peft_model_state_dict(peft_model, adapter)
    return peft_model


def save_adapter(peft_model: PeftModel, path: str | Path) -> None:
    """Write the adapters in peft's format (gathers FSDP2 shards: every rank must call; rank 0 writes)."""
    state = {name: full_tensor(p) for name, p in peft_model.named_parameters() if ".lora_" in name}
    peft_model.save_pretrained(str(path), state_dict=state, is_main_process=is_writer())


def _is_synced(name: str) -> bool:
    return ".lora_" in name or name.startswith(VALUE_HEAD_PREFIX)


def adapter_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """LoRA adapters + value head as CPU tensors: the whole weight sync to a rollout copy.

    Gathers FSDP2-sharded parameters, so every rank must call it.
    """
    state = {name: full_tensor(p) for name, p in policy.named_parameters() if _is_synced(name)}
    if not any(".lora_" in name for name in state):
        raise ValueError("the policy has no LoRA adapters (actor.model.is_lora is false)")
    return state


@torch.no_grad()
def load_adapter_state_dict(policy: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy an ``adapter_state_dict`` into ``policy`` (same names and shapes, or an error)."""
    params = {name: p for name, p in policy.named_parameters() if _is_synced(name)}
    check_keys(
        {k: tuple(p.shape) for k, p in params.items()},
        {k: tuple(v.shape) for k, v in state.items()},
        "adapter state dict",
    )
    for name, p in params.items():
        p.copy_(state[name])
