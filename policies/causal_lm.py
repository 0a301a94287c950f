"""A Hugging Face causal LM (Llama, Qwen2, ... any ``AutoModelForCausalLM`` folder) as a policy
for the text and agent envs (``model_type: causal_lm``).

An action is a response: ``max_new_tokens`` token ids in one chunk (``[B, 1, L]``, int64), EOS
then padding, with a response mask that marks the sampled tokens up to and including EOS, or up
to the token that completes a stop string (``algorithm.sampling_params.stop``).

- ``act(obs)``: batched ``generate`` with a KV cache over the env's left-padded prompts (the
  columns that are padding in every row are cut first), with ``algorithm.sampling_params``;
  per-token log-probs come from the raw logits of each step.
- ``evaluate``: one forward pass over prompt + response with gradients.

Both score a token by ``log_softmax(logits / temperature)``: the temperature-scaled model,
the distribution the loss trains. top-k, top-p, repetition penalty and ``min_new_tokens`` only
shape which tokens are sampled (as generation engines report log-probs).
With ``is_lora`` the attention and MLP projections get LoRA adapters (``policies/lora.py``,
alpha = rank); the base weights stay frozen and ``adapters_disabled`` gives the reference policy.

With ``add_value_head`` (PPO, ``algorithm.adv_type: gae``) a value head (``policies/value_head.py``)
reads the last layer's hidden state at the prompt's last token: one value per step (a turn of an
agent episode), trained with the policy (LoRA adapters or all weights) at ``actor.optim.value_lr``.

Checkpoints: full fine-tuning saves ``model.pt`` (the ``Policy`` default, the value head
included); a LoRA run saves only what trains: the adapter, as peft lays it out
(``lora_adapter/adapter_config.json`` and ``adapter_model.safetensors``:
``PeftModel.from_pretrained(base, folder)`` loads it, and so does ``actor.model.lora_path``), and
the value head beside it (``value_head.pt``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import CheckpointError, expected
from policies.base import MODEL_FILE, ActOutput, EvaluateOutput, Policy, model_option
from policies.causal_core import (LORA_KEYS, LORA_TARGETS, MODEL_KEYS, SAMPLING_KEYS, TOKENIZER_KEYS,
                                  check_length, model_folder, one_response_per_step, prompt_start, sampling_options,
                                  special_tokens, stop_strings, token_columns)
from policies.value_head import ValueHead
from policies.weights import DTYPES, full_tensor, is_writer

VALUE_FILE = "value_head.pt"  # a LoRA run's value head, beside its adapter


class CausalLMPolicy(Policy):
    config_keys = (*MODEL_KEYS, *TOKENIZER_KEYS, *LORA_KEYS, *SAMPLING_KEYS, "attn_implementation", "low_cpu_mem_usage",
                   "add_value_head", "value_head_hidden_sizes")
    checkpoint_keys = ("model_type", "model_path", "tokenizer_model", "is_lora", "lora_rank", "lora_path",
                       "add_value_head", "value_head_hidden_sizes")

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        model_folder(cfg)
        if cfg["add_value_head"] and cfg["value_type"] != "chunk_level":
            raise expected("actor.model.value_type", cfg["value_type"], "chunk_level with a causal_lm value head (one "
                           "value per response: algorithm.reward_type chunk_level)")

    @classmethod
    def check_checkpoint(cls, cfg: Mapping[str, Any], folder: Path, key: str) -> None:
        """The layout ``read_checkpoint`` takes: a LoRA run's adapter (of ``lora_rank``) with
        ``is_lora``, else ``model.pt``."""
        import json

        from policies.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS

        adapter = folder / ADAPTER_DIR
        if cfg["is_lora"]:
            if not (adapter / ADAPTER_WEIGHTS).is_file():
                hint = f"; it holds a full run's {MODEL_FILE}: set actor.model.is_lora=false" \
                    if (folder / MODEL_FILE).is_file() else ""
                raise CheckpointError(f"{key}: {adapter / ADAPTER_WEIGHTS} is missing but actor.model.is_lora is "
                                      f"true{hint}")
            rank = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("r")
            if rank != cfg["lora_rank"]:
                raise expected("actor.model.lora_rank", cfg["lora_rank"],
                               f"{rank}, the rank of the LoRA run in {key}={adapter / ADAPTER_CONFIG}")
            held = (folder / VALUE_FILE).is_file()
            if held != bool(cfg["add_value_head"]):
                raise expected("actor.model.add_value_head", cfg["add_value_head"],
                               f"{held}: {key}={folder} {'holds' if held else 'has no'} a value head ({VALUE_FILE})")
        elif not (folder / MODEL_FILE).is_file():
            if adapter.is_dir():
                raise CheckpointError(f"{key}: {adapter} holds a LoRA run's adapter but actor.model.is_lora is false; "
                                      "set actor.model.is_lora=true (and lora_rank as trained)")
            raise CheckpointError(f"{key}: {folder / MODEL_FILE} is missing (the weights of a causal_lm checkpoint)")

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__(cfg)
        from transformers import AutoModelForCausalLM

        path = model_folder(cfg)
        one_response_per_step(cfg, "causal_lm")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[cfg["precision"]], attn_implementation=cfg["attn_implementation"],
            trust_remote_code=cfg["trust_remote_code"], low_cpu_mem_usage=cfg["low_cpu_mem_usage"])
        self.eos, self.pad = special_tokens(cfg, path)
        self.max_new_tokens = self.action_dim
        check_length(int(model_option(cfg, "max_prompt_length")) + self.max_new_tokens,
                     getattr(model.config, "max_position_embeddings", None), path)
        if cfg["is_lora"]:
            from policies.lora import apply_lora

            model = apply_lora(model, LORA_TARGETS, cfg["lora_rank"], cfg["lora_rank"], cfg.get("lora_path"))
        self.model = model
        self.value_head = None
        if cfg["add_value_head"]:  # one value per response (check_config: value_type chunk_level)
            self.value_head = ValueHead(model.config.hidden_size, tuple(cfg["value_head_hidden_sizes"]), 1).to(
                DTYPES[cfg["precision"]])
        self.sampling = sampling_options(cfg)
        self.stop = stop_strings(cfg, path)
        self.temperature = float(cfg["temperature"])

    @property
    def hf_model(self) -> torch.nn.Module:
        """The Hugging Face model itself (inside the peft wrapper with LoRA)."""
        from peft import PeftModel

        return self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model

    def shard_units(self) -> list[torch.nn.Module]:
        """FSDP2 shards the decoder layers one by one."""
        return list(self.hf_model.model.layers)

    def enable_gradient_checkpointing(self) -> list[torch.nn.Module]:
        self.hf_model.gradient_checkpointing_enable({"use_reentrant": False})
        return list(self.hf_model.model.layers)

    @property
    def has_value_head(self) -> bool:
        return self.value_head is not None

    def value_parameters(self) -> list[torch.nn.Parameter]:
        return [] if self.value_head is None else list(self.value_head.parameters())

    def _value(self, hidden: Tensor) -> Tensor:
        return self.value_head(hidden).squeeze(-1).float()

    @torch.no_grad()
    def values(self, obs: Mapping[str, Any]) -> Tensor | None:
        """The value of each prompt, from the decoder alone (no logits)."""
        if self.value_head is None:
            return None
        ids = torch.as_tensor(obs["input_ids"], dtype=torch.long).to(self.device)
        mask = torch.as_tensor(obs["attention_mask"], dtype=torch.long).to(self.device)
        start = prompt_start(mask)
        ids, mask = ids[:, start:], mask[:, start:]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.hf_model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions)
        return self._value(hidden.last_hidden_state[:, -1]).cpu()

    def frozen_reference(self):
        """With LoRA the base model, adapters off; else None (the actor keeps a frozen copy)."""
        from policies.lora import adapters_disabled

        return None if self.trains_all_weights() else adapters_disabled(self)

    @torch.no_grad()
    def act(self, obs: Mapping[str, Any], do_sample: bool = True, temperature: float | None = None) -> ActOutput:
        from transformers import GenerationConfig, StoppingCriteriaList

        ids = torch.as_tensor(obs["input_ids"], dtype=torch.long).to(self.device, copy=True)
        mask = torch.as_tensor(obs["attention_mask"], dtype=torch.long).to(self.device, copy=True)
        start = prompt_start(mask)
        s = self.sampling
        temperature = temperature or self.temperature
        vocab = self.model.config.vocab_size
        # sampling options only when sampling: greedy ignores them, and transformers warns on each
        # greedy call that sets them; "off" is passed as 0 / 1.0 (None would take the checkpoint's
        # generation_config values)
        sampling = dict(temperature=temperature, top_k=s["top_k"] if 0 < s["top_k"] < vocab else 0,
                        top_p=s["top_p"]) if do_sample else {}
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens, min_new_tokens=s["min_new_tokens"], do_sample=do_sample, **sampling,
            repetition_penalty=s["repetition_penalty"], eos_token_id=self.eos, pad_token_id=self.pad,
            output_logits=True, return_dict_in_generate=True)
        # a row also ends at a stop string
        stopping = StoppingCriteriaList([self.stop.criteria(ids.shape[1] - start)] if self.stop else [])
        out = self.model.generate(input_ids=ids[:, start:], attention_mask=mask[:, start:], generation_config=config,
                                  stopping_criteria=stopping)
        tokens = out.sequences[:, ids.shape[1] - start:]
        logprobs = _token_logprobs(torch.stack(out.logits, dim=1).float() / temperature, tokens)
        response_mask = _response_mask(tokens, self.eos)
        if self.stop:
            ends = self.stop.lengths(tokens).to(tokens.device)
            response_mask *= torch.arange(tokens.shape[1], device=tokens.device)[None] < ends[:, None]
        width = self.max_new_tokens - tokens.shape[1]
        tokens = F.pad(tokens, (0, width), value=self.pad)
        logprobs = F.pad(logprobs * response_mask, (0, width))
        response_mask = F.pad(response_mask, (0, width))
        inputs = {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask}
        return ActOutput(tokens[:, None], logprobs[:, None], self.values(obs), inputs, response_mask[:, None].bool())

    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        ids, mask = forward_inputs["input_ids"].long(), forward_inputs["attention_mask"].long()
        response_mask = forward_inputs["response_mask"].float()
        tokens = torch.as_tensor(actions, device=ids.device).long().reshape(ids.shape[0], -1)
        start, stop = token_columns(mask, response_mask)  # the columns that hold a token in some row
        prompt_width = ids.shape[1] - start
        full = torch.cat([ids[:, start:], tokens[:, :stop]], dim=1)
        attention = torch.cat([mask[:, start:], torch.ones_like(tokens[:, :stop])], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=full, attention_mask=attention, position_ids=positions,
                         output_hidden_states=self.value_head is not None)
        # the value of the prompt: the last layer's state at its last token, as ``values`` reads it
        # (a fresh tensor, as below)
        values = None if self.value_head is None else self._value(out.hidden_states[-1][:, prompt_width - 1]).clone()
        logits = out.logits[:, prompt_width - 1:-1].float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        logprobs = logp.gather(-1, tokens[:, :stop, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        width = tokens.shape[1] - stop
        # fresh tensors, not views: FSDP2's backward hooks on a returned view break under in-place ops
        logprobs = F.pad(logprobs * response_mask[:, :stop], (0, width))[:, None].clone()
        entropy = F.pad(entropy * response_mask[:, :stop], (0, width))[:, None].clone()
        return EvaluateOutput(logprobs, entropy, values)


    @torch.no_grad()
    def probe_logprobs(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> Tensor:
        """At temperature 1 (engines report prompt log-probs before any temperature)."""
        saved, self.temperature = self.temperature, 1.0
        try:
            return super().probe_logprobs(forward_inputs, actions)
        finally:
            self.temperature = saved

    def save_checkpoint(self, path: str | Path) -> None:
        """With LoRA the adapter alone, in peft's layout (collective under FSDP2, rank 0 writes)."""
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            from policies.lora import ADAPTER_DIR, save_adapter

            save_adapter(self.model, Path(path) / ADAPTER_DIR)
            if self.value_head is not None:
                state = {k: full_tensor(v) for k, v in self.value_head.state_dict().items()}
                if is_writer():
                    torch.save(state, Path(path) / VALUE_FILE)
        else:
            super().save_checkpoint(path)

    def read_checkpoint(self, path: str | Path) -> dict[str, Tensor]:
        """What ``save_checkpoint`` wrote, checked against this policy's names and shapes: with
        LoRA the adapter tensors (the trainable ones), otherwise every tensor."""
        from peft import PeftModel
        from safetensors.torch import load_file

        from policies.lora import ADAPTER_DIR, ADAPTER_WEIGHTS
        from policies.weights import check_keys

        path = Path(path)
        if not isinstance(self.model, PeftModel):
            if (path / ADAPTER_DIR).is_dir() and not (path / MODEL_FILE).exists():
                raise CheckpointError(f"{path} holds a LoRA run's {ADAPTER_DIR}/ but actor.model.is_lora is false; "
                                      "set is_lora=true (and lora_rank as trained)")
            return super().read_checkpoint(path)
        file = path / ADAPTER_DIR / ADAPTER_WEIGHTS
        if not file.exists():
            raise CheckpointError(f"{file} is missing (actor.model.is_lora is true: a LoRA run's checkpoint)")
        # peft's file names drop the policy's ``model.`` prefix and the adapter name
        names = {k.removeprefix("model.").replace(".default.", "."): (k, tuple(p.shape))
                 for k, p in self.model.named_parameters(prefix="model") if p.requires_grad}
        saved = load_file(str(file))
        check_keys({f: shape for f, (_, shape) in names.items()}, {k: tuple(v.shape) for k, v in saved.items()},
                   f"LoRA adapter {file}")
        state = {names[k][0]: v for k, v in saved.items()}
        if self.value_head is not None:
            heads = torch.load(path / VALUE_FILE, map_location="cpu", weights_only=True)
            check_keys({k: tuple(v.shape) for k, v in self.value_head.state_dict().items()},
                       {k: tuple(v.shape) for k, v in heads.items()}, f"value head {path / VALUE_FILE}")
            state |= {f"value_head.{k}": v for k, v in heads.items()}
        return state


def _token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def _response_mask(tokens: Tensor, eos: int) -> Tensor:
    """1 for every token up to and including the first EOS of each row, 0 after it."""
    is_eos = (tokens == eos).long()
    ended_before = is_eos.cumsum(-1) - is_eos
    return (ended_before == 0).float()
