"""What a weight sync into a generation engine carries, checked before anything reaches the engine.

A serving engine reloads weights by their Hugging Face checkpoint names, one whole model at a
time: vLLM fuses q/k/v and gate/up into one tensor each, and a reload that misses part of a fused
tensor, or names a tensor the model lacks, leaves the engine half-loaded (measured with vLLM
0.32: garbage outputs or a crash on the next step). So every push here is the complete state,
with names and shapes checked against the model first.

- Full fine-tuning: the actor's ``trainable_state_dict`` is the whole policy state (names
  ``model.<checkpoint name>``); the push is that state under its checkpoint names.
- LoRA: the actor sends only the adapters. The engine gets ``W + scaling * B @ A`` for every
  adapted module, merged onto a CPU copy of the frozen base that never changes (merging onto the
  engine's current weights would add every step's adapter on top of the last one), plus the
  untouched base tensors. Why merging and not the engine's own LoRA: see ``policies/engines``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from core.errors import CheckpointError
from policies.weights import check_keys

POLICY_PREFIX = "model."  # CausalLMPolicy keeps the Hugging Face model as ``self.model``
# adapter tensors as the policy names them, and as peft's adapter file does
_POLICY_ADAPTER = re.compile(r"^model\.base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.default\.weight$")
_FILE_ADAPTER = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def meta_model(path: str | Path, trust_remote_code: bool) -> torch.nn.Module:
    """The model of checkpoint folder ``path`` with shapes and no storage: names and shapes for
    free, whatever the model's size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


class SyncLayout:
    """The names and shapes a policy's ``trainable_state_dict`` has, and how to turn it into the
    complete checkpoint-named state an engine reloads (``engine_state``).

    ``lora`` is None for full fine-tuning; else ``(targets, rank, lora_path)`` as the actor's
    ``CausalLMPolicy`` builds its adapters, so both sides agree on names and scaling.
    """

    def __init__(self, path: str | Path, trust_remote_code: bool, dtype: torch.dtype,
                 lora: tuple[Any, int, str | None] | None = None):
        self.path = Path(path)
        model = meta_model(path, trust_remote_code)
        self.checkpoint_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self.base: dict[str, Tensor] | None = None  # the frozen base, kept only for LoRA merges
        self.scaling: dict[str, float] = {}  # adapted module -> LoRA scaling (alpha / rank)
        if lora is None:
            self.expected = {POLICY_PREFIX + k: shape for k, shape in self.checkpoint_shapes.items()}
            return
        from peft.tuners.lora import LoraLayer

        from policies.lora import apply_lora

        targets, rank, lora_path = lora
        peft_model = apply_lora(model, targets, rank, rank, lora_path)  # as the actor's policy does
        self.expected = {POLICY_PREFIX + k: tuple(p.shape) for k, p in peft_model.named_parameters() if p.requires_grad}
        for name, module in peft_model.named_modules():
            if isinstance(module, LoraLayer):
                self.scaling[name.removeprefix("base_model.model.")] = float(module.scaling["default"])
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.base = {k: v.detach() for k, v in base.state_dict().items()}

    @property
    def is_lora(self) -> bool:
        return self.base is not None

    def check(self, state: Mapping[str, Tensor], source: str = "weight sync") -> None:
        """Names and shapes of ``state`` against what the actor's policy sends (an error names
        the tensors), before anything reaches the engine."""
        check_keys(self.expected, {k: tuple(v.shape) for k, v in state.items()}, source)

    def engine_state(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The complete checkpoint-named state for the engine from a checked trainable state."""
        self.check(state)
        if self.base is None:
            return {k.removeprefix(POLICY_PREFIX): v for k, v in state.items()}
        pairs: dict[str, dict[str, Tensor]] = {}
        for name, tensor in state.items():
            match = _POLICY_ADAPTER.match(name)
            pairs.setdefault(match["module"], {})[match["ab"]] = tensor
        merged = dict(self.base)
        for module, ab in pairs.items():
            weight = self.base[f"{module}.weight"]
            merged[f"{module}.weight"] = torch.addmm(weight.float(), ab["B"].float(), ab["A"].float(),
                                                     alpha=self.scaling[module]).to(weight.dtype)
        return merged

    def read_adapter(self, file: str | Path) -> dict[str, Tensor]:
        """A peft adapter file (``lora_path``, a LoRA checkpoint) under the policy's names."""
        from safetensors.torch import load_file

        state = {}
        for name, tensor in load_file(str(file)).items():
            match = _FILE_ADAPTER.match(name)
            if match is None:
                raise CheckpointError(f"{file}: {name!r} is not a LoRA adapter tensor")
            state[f"{POLICY_PREFIX}base_model.model.{match['module']}.lora_{match['ab']}.default.weight"] = tensor
        self.check(state, f"LoRA adapter {file}")
        return state
