"""What every generation-engine policy shares: a rollout-only ``Policy`` for the text env whose
``act`` returns exactly what ``CausalLMPolicy.act`` returns, so nothing downstream changes.

An engine adapter (``policies/engines/vllm.py``, ``sglang.py``) supplies four things: start the
engine, generate completions with per-token log-probs, score token sequences (prompt log-probs,
for the sync check), and reload a complete checkpoint-named state in place. Everything else is
here: the sampling options of ``actor.model``, groups of identical prompts (the text env's
``group_size`` envs share one) sent once with a sample count, the action / log-prob / mask
tensors, the weight sync (``SyncLayout``: names and shapes checked, LoRA merged) and its check
(``verify_sync``).

Log-probs are those of ``CausalLMPolicy``: ``log_softmax(logits / temperature)`` of the sampled
token, masked after EOS. Engines score sampled tokens either before any processing or after all
of it (temperature, top-k/top-p, penalties, min_new_tokens). At temperature 1 the first is the
policy's exactly, whatever the other options; at another temperature the second is, as long as
top-k, top-p and the repetition penalty are off and past the first ``min_new_tokens`` tokens
(before them EOS is masked out). Otherwise they are the log-probs of the distribution the engine
sampled from; set ``rollout.recompute_logprobs`` to have the actor recompute them. Greedy
(``do_sample=False``: validation) reports log-probs at temperature 1.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from core.errors import ConfigError
from policies.base import MODEL_FILE, ActOutput, EvaluateOutput, Policy, model_option
from policies.causal_core import (LORA_KEYS, LORA_TARGETS, MODEL_KEYS, SAMPLING_KEYS, TOKENIZER_KEYS, check_length,
                                  model_folder, one_response_per_step, sampling_options, special_tokens,
                                  stop_strings)
from policies.engines.probe import SYNC_TOLERANCE, ProbeBatch, SyncMismatchError, sync_gap
from policies.engines.weights import SyncLayout
from policies.weights import DTYPES

MAX_MESSAGE = 400  # characters of an engine's start error kept in ours
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # actor.model.precision -> engine dtype


@dataclass
class Sampling:
    """One ``act`` call's sampling request, in the policy's terms; each adapter translates it."""

    temperature: float  # 0: greedy
    top_k: int  # 0: off
    top_p: float
    repetition_penalty: float
    min_new_tokens: int
    max_new_tokens: int
    stop_token_id: int
    seed: int | None  # None: greedy
    stop: tuple[str, ...] = ()  # stop strings (the policy cuts at them too: ``StopStrings``)


@dataclass
class Completion:
    """One generated response: its tokens (up to and including EOS) and their log-probs."""

    tokens: list[int]
    logprobs: list[float]


class EnginePolicy(Policy):
    """A causal LM served by a generation engine, for rollouts only (``evaluate`` is the actor's).

    Built from ``actor.model`` (the same options as ``causal_lm``) and the ``rollout`` section:
    ``rollout_keys`` maps the rollout keys an engine reads to its own arguments, and
    ``refused_rollout_keys`` says why the others cannot apply (each adapter has both tables).
    ``cpu_threads`` is the number of threads the engine computes with on a CPU machine (the CPU
    slots of the rollout worker); None keeps torch's current setting.
    """

    backend: ClassVar[str]  # the rollout.backend value
    config_keys = (*MODEL_KEYS, *TOKENIZER_KEYS, *LORA_KEYS, *SAMPLING_KEYS)
    rollout_keys: ClassVar[dict[str, str]] = {}
    refused_rollout_keys: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: Mapping[str, Any], rollout: Mapping[str, Any], cpu_threads: int | None = None):
        super().__init__(cfg)
        from transformers import AutoConfig

        self.path = model_folder(cfg)
        one_response_per_step(cfg, f"rollout.backend={self.backend}")
        usage = rollout.get("gpu_memory_utilization")
        if usage is not None and not 0 < float(usage) <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization = {usage!r}: expected a fraction in (0, 1]")
        self.precision = cfg["precision"]
        self.dtype = DTYPES[self.precision]
        self.trust_remote_code = bool(cfg["trust_remote_code"])
        self.eos, self.pad = special_tokens(cfg, self.path)
        self.max_new_tokens = self.action_dim
        self.max_model_len = int(model_option(cfg, "max_prompt_length")) + self.max_new_tokens
        model_config = AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        self.vocab_size = model_config.vocab_size
        # the sync check scores whole prompt + response sequences, with one token of generation
        self.engine_len = self.max_model_len + 1
        check_length(self.max_model_len, getattr(model_config, "max_position_embeddings", None), self.path, extra=1,
                     why=f"rollout.backend={self.backend} scores whole sequences after each weight sync")
        self.sampling = sampling_options(cfg)
        self.stop = stop_strings(cfg, self.path)  # applied to the engine's tokens (act), the same as Hugging Face's
        self.tokenizer_path = cfg.get("tokenizer_model") or self.path  # for an engine that matches stop strings
        self.temperature = float(cfg["temperature"])
        lora = (LORA_TARGETS, int(cfg["lora_rank"]), cfg.get("lora_path")) if cfg["is_lora"] else None
        self.layout = SyncLayout(self.path, self.trust_remote_code, self.dtype, lora)
        self._start(rollout, cpu_threads)
        if lora is not None and lora[2] is not None:  # lora_path: the adapter that training starts from
            from policies.lora import ADAPTER_WEIGHTS

            self.load_trainable_state_dict(self.layout.read_adapter(Path(lora[2]) / ADAPTER_WEIGHTS))

    # ------------------------------------------------------------------ engine
    @classmethod
    def unavailable(cls) -> str | None:
        """Why the engine cannot run on this machine (not installed, no GPU), or None; cheap, for
        the driver's checks before any worker starts."""
        return None

    @abstractmethod
    def _start(self, rollout: Mapping[str, Any], cpu_threads: int | None) -> None:
        """Start the engine on ``self.path``; a failure is a ``ConfigError`` naming the key."""

    @abstractmethod
    def _generate(self, prompts: list[list[int]], counts: list[int], sampling: Sampling) -> list[list[Completion]]:
        """``counts[i]`` completions of ``prompts[i]`` each, in order."""

    @abstractmethod
    def _prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """For each sequence, the log-prob of every token after the first given those before it
        (temperature 1)."""

    @abstractmethod
    def _push(self, state: dict[str, Tensor]) -> None:
        """Reload the engine's weights in place from a complete checkpoint-named state."""

    def shutdown(self) -> None:
        """Stop the engine and free what it holds (also done when the process ends)."""

    def start_error(self, error: Exception) -> ConfigError:
        """The one-line error for an engine that did not start, naming the key to fix."""
        message = " ".join(str(error).split()) or type(error).__name__
        message = message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + " ..."
        if "memory" in message.lower() and "utilization" in message.lower():
            return ConfigError(f"rollout.gpu_memory_utilization: the {self.backend} engine did not start: {message}")
        return ConfigError(f"rollout.backend={self.backend} cannot serve actor.model.model_path = {str(self.path)!r}: "
                           f"{type(error).__name__}: {message}")

    # ----------------------------------------------------------------- rollout
    @property
    def device(self) -> torch.device:
        """Where ``act``'s tensors are: the engine's own device stays inside the engine."""
        return torch.device("cpu")

    def request(self, do_sample: bool, temperature: float | None = None) -> Sampling:
        s = self.sampling
        top_k = int(s["top_k"])
        return Sampling(
            temperature=float(temperature or s["temperature"]) if do_sample else 0.0,
            top_k=top_k if do_sample and 0 < top_k < self.vocab_size else 0,
            top_p=float(s["top_p"]) if do_sample else 1.0,
            repetition_penalty=float(s["repetition_penalty"]), min_new_tokens=int(s["min_new_tokens"]),
            max_new_tokens=self.max_new_tokens, stop_token_id=self.eos,
            # drawn from torch's generator, so that torch.manual_seed makes a rollout repeatable
            seed=int(torch.randint(2**31 - 1, ())) if do_sample else None,
            stop=self.stop.strings if self.stop else ())

    @torch.no_grad()
    def act(self, obs: Mapping[str, Any], do_sample: bool = True, temperature: float | None = None) -> ActOutput:
        ids = torch.as_tensor(obs["input_ids"], dtype=torch.long).cpu()
        mask = torch.as_tensor(obs["attention_mask"], dtype=torch.long).cpu()
        prompts, counts = group_prompts(ids, mask)
        request = self.request(do_sample, temperature)
        completions = [c for group in self._generate(prompts, counts, request) for c in group]
        width = self.max_new_tokens
        tokens = torch.full((len(completions), width), self.pad, dtype=torch.long)
        logprobs = torch.zeros(len(completions), width)
        lengths = torch.tensor([len(c.tokens) for c in completions])
        for row, c in enumerate(completions):
            tokens[row, :len(c.tokens)] = torch.tensor(c.tokens, dtype=torch.long)
            logprobs[row, :len(c.tokens)] = torch.tensor(c.logprobs)
        if self.stop:  # what an engine generated past a stop string is dropped
            lengths = torch.minimum(lengths, self.stop.lengths(tokens))
        response_mask = (torch.arange(width)[None] < lengths[:, None]).float()
        tokens = tokens.masked_fill(response_mask == 0, self.pad)
        inputs = {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask}
        return ActOutput(tokens[:, None], (logprobs * response_mask)[:, None], None, inputs,
                         response_mask[:, None].bool())

    def evaluate(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> EvaluateOutput:
        raise NotImplementedError(f"rollout.backend={self.backend} generates rollouts only; the actor's "
                                  "causal_lm policy computes the training log-probs")

    # ----------------------------------------------------------------- weights
    @torch.no_grad()
    def load_trainable_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """The actor's ``trainable_state_dict`` into the running engine, in place: checked
        (a ``CheckpointError`` names the tensors, and the engine keeps its weights), LoRA
        adapters merged onto the frozen base, then pushed whole."""
        self._push(self.layout.engine_state(state))

    @torch.no_grad()
    def probe_logprobs(self, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> Tensor:
        """The engine's log-probs of the probe's responses, ``[B, 1, L]`` (0 past EOS), at temperature 1."""
        probe = ProbeBatch.from_inputs(forward_inputs, actions)
        sequences = probe.sequences()
        scores = self._prompt_logprobs(sequences)
        out = torch.zeros(probe.actions.shape, dtype=torch.float32)
        for row, (seq, score) in enumerate(zip(sequences, scores)):
            prompt = int(probe.attention_mask[row].sum())
            n = len(seq) - prompt
            out[row, 0, :n] = torch.tensor(score[prompt - 1:prompt - 1 + n])
        return out

    def verify_sync(self, forward_inputs: Mapping[str, Tensor], actions: Tensor, actor_logprobs: Tensor, *,
                    step: int, tolerance: float | None = None) -> float:
        """Compare the engine's log-probs of a probe (``act``'s ``forward_inputs`` and actions of a
        few responses) with the actor's (its ``Policy.probe_logprobs``) after the sync of ``step``:
        returns the largest per-token gap (``rollout/sync_logprob_gap``), or raises
        ``SyncMismatchError`` naming the step and the gap when it exceeds ``tolerance`` (default by
        the engine's dtype, ``SYNC_TOLERANCE``)."""
        tolerance = SYNC_TOLERANCE[self.precision] if tolerance is None else tolerance
        gap = sync_gap(self.probe_logprobs(forward_inputs, actions), actor_logprobs, forward_inputs["response_mask"])
        if not gap <= tolerance:  # NaN included
            raise SyncMismatchError(
                f"step {step}: after the weight sync the {self.backend} engine's log-probs of the probe batch differ "
                f"from the actor's by {gap:.3g} (tolerance {tolerance:.3g} for {self.precision}): rollouts would not "
                "sample the trained weights")
        return gap

    def read_checkpoint(self, path: str | Path) -> dict[str, Tensor]:
        """A training checkpoint's weights as the actor's ``trainable_state_dict`` names them
        (``embodied-eval`` with an engine): ``model.pt``, or a LoRA run's peft adapter."""
        if not self.layout.is_lora:
            return super().read_checkpoint(path)
        from policies.lora import ADAPTER_DIR, ADAPTER_WEIGHTS

        file = Path(path) / ADAPTER_DIR / ADAPTER_WEIGHTS
        if not file.exists():
            raise ConfigError(f"{file} is missing (actor.model.is_lora is true: a LoRA run's checkpoint)")
        return self.layout.read_adapter(file)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        raise NotImplementedError(f"rollout.backend={self.backend}: the weights come from the actor, not from "
                                  "the engine")

    def release_weights(self) -> None:
        """Nothing: the engine keeps its weights between phases (rollout.enable_offload is refused)."""

    def restore_weights(self) -> None:
        """Nothing (see ``release_weights``)."""

    def save_checkpoint(self, path: str | Path) -> None:
        raise NotImplementedError(f"rollout.backend={self.backend}: checkpoints are the actor's ({MODEL_FILE} "
                                  "or the LoRA adapter)")


def group_prompts(ids: Tensor, mask: Tensor) -> tuple[list[list[int]], list[int]]:
    """Left-padded prompt rows as token lists, runs of identical consecutive rows merged with
    their count: the text env's groups, generated as one request with that many samples."""
    prompts: list[list[int]] = []
    counts: list[int] = []
    for row, keep in zip(ids, mask):
        prompt = row[keep.bool()].tolist()
        if prompts and prompts[-1] == prompt:
            counts[-1] += 1
        else:
            prompts.append(prompt)
            counts.append(1)
    return prompts, counts

