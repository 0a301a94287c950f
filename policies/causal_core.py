"""What the three causal-LM policies share, written once: the Hugging Face policy
(``causal_lm.py``), the generation engines' (``engines/base.py``) and Megatron's
(``megatron/policy.py``). The ``actor.model`` keys each group of options is, the checks of the
model folder and of its length, the EOS and padding ids, the sampling options, where responses end
at a stop string, and which columns of a batch hold tokens at all."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from core.errors import ConfigError

MODEL_KEYS = ("model_path", "precision", "max_prompt_length")
TOKENIZER_KEYS = ("trust_remote_code", "tokenizer_model", "tokenizer_use_fast", "tokenizer_trust_remote_code",
                  "eos_token_id", "pad_token_id")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "min_new_tokens", "stop")
LORA_KEYS = ("is_lora", "lora_rank", "lora_path")
LORA_TARGETS = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"


def model_folder(cfg: Mapping[str, Any]) -> Path:
    """``model_path``, a Hugging Face model folder, or one error naming the key."""
    path = cfg.get("model_path")
    if path is None or not (Path(path) / "config.json").is_file():
        raise ConfigError(f"actor.model.model_path = {None if path is None else str(path)!r}: expected a Hugging "
                          "Face model folder (with config.json)")
    return Path(path)


def one_response_per_step(cfg: Mapping[str, Any], what: str) -> None:
    chunks = cfg.get("num_action_chunks", 1)
    if chunks != 1:
        raise ConfigError(f"actor.model.num_action_chunks = {chunks}: expected 1 for {what} (one response per step)")


def check_length(length: int, limit: int | None, path: Path, extra: int = 0, why: str = "") -> None:
    """``runner.seq_length`` (``length``) and ``extra`` tokens must fit the model's ``limit`` positions."""
    if limit is not None and length + extra > limit:
        more = f" + {extra}" if extra else ""
        raise ConfigError(f"runner.seq_length ({length}){more} exceeds the {limit} positions of the model in "
                          f"{path}{f' ({why})' if why else ''}")


def tokenizer_of(cfg: Mapping[str, Any], path: Path) -> Any:
    """The tokenizer the options name (``tokenizer_model``, else the model folder's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.get("tokenizer_model") or path, use_fast=cfg["tokenizer_use_fast"],
                                         trust_remote_code=cfg["tokenizer_trust_remote_code"])


def special_tokens(cfg: Mapping[str, Any], path: Path) -> tuple[int, int]:
    """(EOS, padding) ids: the options' when set, else the tokenizer's (padding falls back to EOS)."""
    folder = cfg.get("tokenizer_model") or path
    tokenizer = tokenizer_of(cfg, path)
    eos = cfg["eos_token_id"] if cfg.get("eos_token_id") is not None else tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"the tokenizer in {folder} has no EOS token: set rollout.eos")
    pad = cfg["pad_token_id"] if cfg.get("pad_token_id") is not None else tokenizer.pad_token_id
    return eos, eos if pad is None else pad


def sampling_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: cfg[k] for k in SAMPLING_KEYS}


def stop_strings(cfg: Mapping[str, Any], path: Path) -> StopStrings | None:
    """``stop`` (``algorithm.sampling_params.stop``): where responses end besides EOS, or None."""
    stop = cfg.get("stop") or ()
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"algorithm.sampling_params.stop = {stop!r}: expected a list of non-empty strings, or null")
    return StopStrings(tokenizer_of(cfg, path), tuple(stop)) if stop else None


class StopStrings:
    """Where responses end at a stop string: after the first generated token at which the
    response's text (decoded without special tokens, the prompt left out, as vLLM matches them)
    holds one. ``lengths`` says where, for tokens from any backend; ``criteria`` ends rows early
    inside Hugging Face's ``generate`` (never before ``lengths`` would)."""

    def __init__(self, tokenizer: Any, strings: tuple[str, ...]):
        self.tokenizer, self.strings = tokenizer, strings
        self.window = max(map(len, strings)) + 1  # tokens that can hold a stop string: each is a character or more

    def holds(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.strings)

    def lengths(self, tokens: Tensor) -> Tensor:
        """``[B]`` response lengths: up to and including the token that completes a stop string,
        else the whole row."""
        rows = tokens.tolist()
        out = torch.full((len(rows),), tokens.shape[1])
        for row, ids in enumerate(rows):
            if self.holds(ids):  # the shortest prefix that holds one (a prefix's text only grows)
                lo, hi = 1, len(ids)
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if self.holds(ids[:mid]) else (mid + 1, hi)
                out[row] = lo
        return out

    def criteria(self, start: int) -> Any:
        """A ``generate`` stopping criterion for sequences whose responses start at column ``start``."""
        from transformers import StoppingCriteria

        stop = self

        class Stopped(StoppingCriteria):
            def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
                tails = input_ids[:, start:][:, -stop.window:].tolist()
                return torch.tensor([stop.holds(t) for t in tails], dtype=torch.bool, device=input_ids.device)

        return Stopped()


def token_columns(mask: Tensor, response_mask: Tensor) -> tuple[int, int]:
    """The columns of a batch that hold a token in some row: prompts start at column ``start``
    (left of it every row is padding), responses end before column ``stop``."""
    stop = int((response_mask.sum(0) > 0).nonzero()[-1]) + 1 if response_mask.any() else 1
    return prompt_start(mask), stop


def prompt_start(mask: Tensor) -> int:
    """The first column where some row's prompt has a token (left-padded prompts)."""
    return int((mask.sum(0) > 0).nonzero()[0]) if mask.any() else 0

