"""The causal LM as a Megatron-Core ``GPTModel``: the training side of ``causal_lm`` under
``actor.training_backend: megatron`` (the rollout side stays ``policies/causal_lm.py``).

- ``evaluate`` has the contract and the numbers of ``CausalLMPolicy.evaluate``: per-token
  log-probs of ``log_softmax(logits / temperature)`` and entropies, ``[B, 1, L]``, zero outside
  the response mask; computed from vocab-parallel logits (``vocab_parallel.py``), never gathered.
- Weights leave in the Hugging Face layout: ``trainable_state_dict`` gathers the tensor-parallel
  shards into the rollout policy's names (``model.`` + the HF name), and ``export_pretrained``
  writes an HF folder. Checkpoints are Megatron ``dist_checkpointing`` folders, loadable at any
  tensor-parallel size.
- Training it needs ``training.py``'s gradient all-reduce and clip instead of FSDP's.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from core.errors import ConfigError
from policies.base import ActOutput, EvaluateOutput, Policy, model_option
from policies.causal_core import MODEL_KEYS, token_columns
from policies.megatron import checkpoint, training, vocab_parallel
from policies.megatron.model import (
    MegatronOptions,
    build_from_hf,
    load_megatron_state,
    recompute_every_layer,
)
from policies.megatron.options import check_options
from policies.megatron.weights import hf_to_megatron, megatron_to_hf

LORA = ("LoRA with Megatron, because Megatron-Core has no LoRA for its tensor-parallel layers and peft wraps "
        "torch Linear layers; train LoRA with actor.training_backend fsdp")
HF_PREFIX = "model."  # CausalLMPolicy holds the HF model as ``.model``: its state dict's prefix
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


class MegatronCausalLMPolicy(Policy):
    config_keys = (*MODEL_KEYS, "temperature", "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
                   "recompute_granularity", "recompute_method", "recompute_num_layers", "seq_length",
                   "activation", "normalization", "position_embedding_type", "attention_softmax_in_fp32",
                   "use_cpu_initialization", "megatron_checkpoint", "apply_rope_fusion", "bias_dropout_fusion",
                   "persist_layer_norm", "bias_activation_fusion", "gradient_accumulation_fusion")
    refused_keys = {"add_value_head": "a value head, because the Megatron causal LM has none (PPO's critic trains "
                                      "with actor.training_backend fsdp; GRPO needs none)",
                    "is_lora": LORA}

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__(cfg)
        check_options(cfg, dist.get_world_size() if dist.is_initialized() else 1)
        self.cfg = dict(cfg)
        self.model_path = Path(model_option(cfg, "model_path"))
        self.temperature = float(cfg["temperature"])
        self.model, self.arch = build_from_hf(self.model_path, MegatronOptions.from_config(cfg))
        if cfg.get("megatron_checkpoint"):
            load_megatron_state(self.model, checkpoint.load_model_state(self.model, cfg["megatron_checkpoint"]),
                                f"actor.model.megatron_checkpoint={cfg['megatron_checkpoint']!r}")

    def __deepcopy__(self, memo: dict) -> MegatronCausalLMPolicy:
        """A policy with a copy of these weights (the actor's frozen KL reference), built anew:
        Megatron's modules hold process groups, which cannot be copied."""
        twin = type(self)(self.cfg)
        twin.load_state_dict(self.state_dict())
        return twin.train(self.training)

    # ----------------------------------------------------------------- rollout
    def act(self, obs: Mapping[str, Any], do_sample: bool = True, temperature: float | None = None) -> ActOutput:
        raise ConfigError("actor.training_backend=megatron trains the causal LM; rollouts generate with "
                          "policies/causal_lm.py (rollout.backend), which loads trainable_state_dict()")

    # ---------------------------------------------------------------- training
    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        """As ``CausalLMPolicy.evaluate``. Each row is rotated left past its prompt's padding,
        so that every sequence starts at position 0 and padding sits at the end, where a causal
        mask keeps it out of every real token's attention: positions and masking equal the HF
        model's, and Megatron's rotary embedding (positions 0..S-1, no position ids) applies."""
        ids, mask = forward_inputs["input_ids"].long(), forward_inputs["attention_mask"].long()
        response_mask = forward_inputs["response_mask"].float()
        device = self.device
        tokens = torch.as_tensor(actions, device=ids.device).long().reshape(ids.shape[0], -1)
        start, stop = token_columns(mask, response_mask)  # the columns that hold a token in some row
        prompt = ids[:, start:]
        padding = (mask[:, start:] == 0).sum(1, keepdim=True)  # left padding of each row
        full = torch.cat([prompt, tokens[:, :stop]], dim=1).to(device)
        width = full.shape[1]
        columns = torch.arange(width, device=device)
        rotated = full.gather(1, (columns + padding.to(device)) % width)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]  # True: hidden
        logits = self.model(rotated, columns[None].expand_as(rotated), causal)  # [B, S, V / tp]
        # response token k sits at rotated column prompt_width + k - padding; the logits one before predict it
        where = prompt.shape[1] - 1 - padding.to(device) + torch.arange(stop, device=device)
        logits = logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1])).float() / self.temperature
        logits = vocab_parallel.mask_padding(logits, self.arch.vocab_size)
        entropy = vocab_parallel.entropy(logits)
        logprobs = vocab_parallel.token_logprobs(logits, tokens[:, :stop].to(device))  # overwrites logits: last
        keep = response_mask[:, :stop].to(device)
        pad = tokens.shape[1] - stop
        return EvaluateOutput(F.pad(logprobs * keep, (0, pad))[:, None], F.pad(entropy * keep, (0, pad))[:, None], None)

    @torch.no_grad()
    def probe_logprobs(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> Tensor:
        """At temperature 1, as ``CausalLMPolicy.probe_logprobs``; every rank calls it."""
        saved, self.temperature = self.temperature, 1.0
        try:
            return super().probe_logprobs(forward_inputs, actions)
        finally:
            self.temperature = saved

    def enable_gradient_checkpointing(self) -> list[torch.nn.Module]:
        """``actor.model.gradient_checkpointing``: every decoder layer recomputed in backward
        (Megatron's full recompute, uniform, one layer per chunk)."""
        return recompute_every_layer(self.model)

    # ----------------------------------------------------------------- weights
    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, Tensor]:
        """The full weights under HF names (``AutoModelForCausalLM.state_dict()``), as CPU tensors,
        gathered over the tensor-parallel group (a collective of that group)."""
        from megatron.core import parallel_state

        local = {k: v.detach().cpu() for k, v in self.model.named_parameters()}
        group = parallel_state.get_tensor_model_parallel_group()
        shards = [local]
        if dist.get_world_size(group) > 1:
            shards = [{} for _ in range(dist.get_world_size(group))]
            for name, tensor in local.items():
                parts = [torch.empty_like(tensor) for _ in shards]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                for shard, part in zip(shards, parts):
                    shard[name] = part
        return megatron_to_hf(shards, self.arch, self.model.uses_fused_norms)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The weight sync to the rollout: every weight, in the rollout ``CausalLMPolicy``'s
        names and layout (never Megatron's); every rank must call it."""
        return {HF_PREFIX + k: v for k, v in self.hf_state_dict().items()}

    @torch.no_grad()
    def load_trainable_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Take a ``trainable_state_dict`` (HF layout, e.g. from an FSDP run): this rank's shards of it."""
        from megatron.core import parallel_state

        hf = {k.removeprefix(HF_PREFIX): v for k, v in state.items()}
        local = hf_to_megatron(hf, self.arch, parallel_state.get_tensor_model_parallel_rank(),
                               parallel_state.get_tensor_model_parallel_world_size(), self.model.uses_fused_norms)
        load_megatron_state(self.model, local, "trainable state dict")

    def save_checkpoint(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A Megatron ``dist_checkpointing`` folder of the weights (and of ``optimizer``'s state);
        every rank writes its shards."""
        checkpoint.save(self.model, path, optimizer)

    def read_checkpoint(self, path: str | Path) -> dict[str, Tensor]:
        """The weights of a ``save_checkpoint`` folder (written at any tensor-parallel size) as
        this policy's state dict for this rank (strict ``load_state_dict``: the modules'
        ``_extra_state`` entries the folder leaves out are this model's own)."""
        state = {f"model.{k}": v for k, v in checkpoint.load_model_state(self.model, path).items()}
        extra = {k: v for k, v in self.state_dict().items() if k.endswith("._extra_state")}
        return {**extra, **state}

    def load_optimizer(self, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
        """Restore the optimizer state a ``save_checkpoint(path, optimizer)`` wrote."""
        checkpoint.load_optimizer(self.model, optimizer, path)

    def export_pretrained(self, path: str | Path) -> None:
        """An HF folder (config.json, safetensors, the tokenizer files of ``model_path``) that
        ``AutoModelForCausalLM.from_pretrained`` and ``causal_lm`` read; every rank calls, the
        first writes."""
        from transformers import AutoConfig, AutoModelForCausalLM

        state = self.hf_state_dict()
        if dist.get_rank() == 0:
            config = AutoConfig.from_pretrained(self.model_path)
            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(config)
            shell.save_pretrained(path, state_dict=state)
            for name in TOKENIZER_FILES:
                if (self.model_path / name).is_file():
                    shutil.copy(self.model_path / name, Path(path) / name)
        dist.barrier()

    # ------------------------------------------------------- training helpers
    def reduce_gradients(self) -> None:
        """After the last backward of a step: see ``training.reduce_gradients``."""
        training.reduce_gradients(self.model)

    def clip_grad_norm(self, max_norm: float, params: list[Tensor] | None = None, sharded: bool = False) -> float:
        """After ``reduce_gradients``: see ``training.clip_grad_norm`` (``params``: what the
        optimizer steps, if not the model's parameters: mixed precision's fp32 main weights, the
        distributed optimizer's share)."""
        params = params if params is not None else list(self.model.parameters())
        return training.clip_grad_norm(params, max_norm, sharded)
