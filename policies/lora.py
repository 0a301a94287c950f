"""LoRA for RL fine-tuning of any policy (OpenVLA-OFT, causal LMs).

A policy names its target modules (a peft regex or list); everything else is shared: adapters
are saved and read in peft's folder format, so an adapter folder (``lora_path``) written by peft
or by another framework loads, strictly: any adapter tensor without a home is an error. The
frozen base makes the weight sync carry only what trains (``Policy.trainable_state_dict``: the
adapters and the value head), and gives the KL reference (``adapters_disabled``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from policies.weights import CheckpointError, check_keys, full_tensor, is_writer

ADAPTER_DIR = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def apply_lora(model: nn.Module, targets: str | list[str], rank: int, alpha: float,
               lora_path: str | Path | None = None) -> PeftModel:
    """Wrap ``model`` with trainable LoRA adapters on ``targets`` (fresh, or read from
    ``lora_path``); the base weights are frozen."""
    if lora_path is None:
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            target_modules=targets,
            init_lora_weights="gaussian",
        )
        return get_peft_model(model, config)
    path = Path(lora_path)
    if not (path / ADAPTER_CONFIG).exists() or not (path / ADAPTER_WEIGHTS).exists():
        raise CheckpointError(f"actor.model.lora_path={str(path)!r} needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = LoraConfig.from_pretrained(str(path))
    if config.r != rank:
        raise CheckpointError(f"actor.model.lora_rank={rank} but the adapter at {path} has rank {config.r}")
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


@contextmanager
def adapters_disabled(policy: nn.Module) -> Iterator[None]:
    """Inside, ``policy`` computes as its frozen base model: the KL reference of a LoRA run,
    with no second copy of the weights."""
    with ExitStack() as stack:
        for module in policy.modules():
            if isinstance(module, PeftModel):
                stack.enter_context(module.disable_adapter())
        yield
