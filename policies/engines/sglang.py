"""SGLang as the text env's rollout engine (``rollout.backend: sglang``), written against SGLang's
documented offline engine API: ``sglang.Engine(**server_args)``, ``Engine.generate(input_ids=...,
sampling_params=..., return_logprob=True, logprob_start_len=...)``, whose results carry
``meta_info["output_token_logprobs"]`` / ``["input_token_logprobs"]`` as ``(logprob, token_id,
text)`` rows, and ``Engine.update_weights_from_tensor(named_tensors, flush_cache=True)``, which
returns ``(success, message)``.

UNVERIFIED: SGLang needs CUDA (it pins a CUDA torch and CUDA-only kernels; no CPU build on
PyPI), so this adapter has never run; ``tests/test_engines.py`` checks its request and response
mapping against the documented shapes only. Without SGLang or a GPU it stops with one error
naming ``rollout.backend``.

Choices, shared with the vLLM adapter where the APIs allow:
- one request per row: SGLang's docs advise repeating a prompt rather than ``n > 1``, and its
  radix cache shares the prompt's prefill across the group anyway;
- sampling log-probs are SGLang's default, after temperature (``log_softmax(logits / T)``,
  before top-k/top-p), which is the policy's; prompt log-probs (the sync check) are at temperature 1;
- LoRA: adapters merged onto the base and pushed whole, as for vLLM (SGLang's
  ``load_lora_adapter_from_tensors`` would serve the adapter per request, at the cost of every
  token's speed);
- sampling is seeded by the engine's ``random_seed`` only (per-request seeds need SGLang's
  deterministic mode).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from core.errors import ConfigError
from policies.engines.base import ENGINE_DTYPES, Completion, EnginePolicy, Sampling

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("rollout.gpu_memory_utilization", "rollout.enforce_eager", "rollout.tensor_parallel_size",
               "rollout.pipeline_parallel_size", "rollout.attention_backend", "rollout.max_running_requests",
               "rollout.cuda_graph_max_bs", "rollout.use_torch_compile", "rollout.torch_compile_max_bs",
               "rollout.sglang_decode_log_interval")
# rollout.<key> -> sglang.Engine (ServerArgs) argument, same meaning
ROLLOUT_KEYS = {
    "gpu_memory_utilization": "mem_fraction_static",  # weights + KV cache pool
    "enforce_eager": "disable_cuda_graph",
    "tensor_parallel_size": "tp_size",
    "pipeline_parallel_size": "pp_size",
    "attention_backend": "attention_backend",
    "max_running_requests": "max_running_requests",
    "cuda_graph_max_bs": "cuda_graph_max_bs",
    "use_torch_compile": "enable_torch_compile",
    "torch_compile_max_bs": "torch_compile_max_bs",
    "sglang_decode_log_interval": "decode_log_interval",
}
REFUSED_ROLLOUT_KEYS = {
    "distributed_executor_backend": "choosing vLLM's executor, because rollout.backend is sglang",
    "disable_log_stats": "vLLM's statistics switch, because rollout.backend is sglang "
                         "(rollout.sglang_decode_log_interval sets SGLang's)",
    "enable_offload": "offloading the engine between phases, because SGLang's memory release is not wired here",
    "validate_weight": "weight comparison dumps, because every sync is checked on a probe batch instead "
                       "(EnginePolicy.verify_sync)",
    "validate_save_dir": "weight comparison dumps, because every sync is checked on a probe batch instead",
}


def engine_args(path: str, precision: str, context_length: int, trust_remote_code: bool,
                rollout: Mapping[str, Any]) -> dict[str, Any]:
    """The ``sglang.Engine`` keyword arguments for a model folder and the rollout section."""
    args = {arg: rollout[key] for key, arg in ROLLOUT_KEYS.items() if rollout.get(key) is not None}
    args.update(model_path=path, dtype=ENGINE_DTYPES[precision], context_length=context_length,
                trust_remote_code=trust_remote_code, random_seed=0, log_level="error",
                skip_tokenizer_init=True,  # prompts arrive as token ids
                sampling_defaults="openai")  # sampling is ours, not the checkpoint's generation_config.json
    return args


def sampling_params(sampling: Sampling) -> dict[str, Any]:
    """SGLang's sampling parameters for one request (its top-k is off at -1)."""
    return {"temperature": sampling.temperature, "top_k": sampling.top_k or -1, "top_p": sampling.top_p,
            "repetition_penalty": sampling.repetition_penalty, "min_new_tokens": sampling.min_new_tokens,
            "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": [sampling.stop_token_id]}


def generate_request(prompts: Sequence[list[int]], counts: Sequence[int], sampling: Sampling) -> dict[str, Any]:
    """``Engine.generate`` keyword arguments: each prompt repeated ``counts[i]`` times."""
    rows = [prompt for prompt, count in zip(prompts, counts) for _ in range(count)]
    return {"input_ids": rows, "sampling_params": sampling_params(sampling), "return_logprob": True}


def parse_completions(results: Sequence[Mapping[str, Any]], counts: Sequence[int]) -> list[list[Completion]]:
    """Completions from ``Engine.generate``'s results (one per row, in order), grouped by prompt."""
    completions = []
    for result in results:
        rows = result["meta_info"]["output_token_logprobs"]
        completions.append(Completion([int(r[1]) for r in rows], [float(r[0]) for r in rows]))
    groups, start = [], 0
    for count in counts:
        groups.append(completions[start:start + count])
        start += count
    return groups


def scoring_request(sequences: Sequence[list[int]]) -> dict[str, Any]:
    """``Engine.generate`` keyword arguments that score every token of ``sequences``."""
    return {"input_ids": list(sequences), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}


def parse_prompt_logprobs(results: Sequence[Mapping[str, Any]]) -> list[list[float]]:
    """Log-probs of each sequence's tokens after the first (the first row has none)."""
    return [[float(r[0]) for r in result["meta_info"]["input_token_logprobs"][1:]] for result in results]


class SGLangCausalLM(EnginePolicy):
    """``causal_lm`` rollouts generated by an SGLang engine (see the module docstring: unverified)."""

    backend = "sglang"
    rollout_keys = ROLLOUT_KEYS
    refused_rollout_keys = REFUSED_ROLLOUT_KEYS

    @classmethod
    def unavailable(cls) -> str | None:
        if not torch.cuda.is_available():
            return "SGLang needs a CUDA GPU (it has no CPU build); use rollout.backend vllm or huggingface here"
        if importlib.util.find_spec("sglang") is None:
            return "SGLang is not installed (pip install 'sglang[all]' on a CUDA machine)"
        return None

    def _start(self, rollout: Mapping[str, Any], cpu_threads: int | None) -> None:
        why = self.unavailable()
        if why:
            raise ConfigError(f"rollout.backend = 'sglang': not supported here, because {why}")
        import sglang

        try:
            self.engine = sglang.Engine(**engine_args(str(self.path), self.precision, self.engine_len,
                                                      self.trust_remote_code, rollout))
        except Exception as error:
            raise self.start_error(error) from error

    def _generate(self, prompts: list[list[int]], counts: list[int], sampling: Sampling) -> list[list[Completion]]:
        results = self.engine.generate(**generate_request(prompts, counts, sampling))
        return parse_completions(results, counts)

    def _prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return parse_prompt_logprobs(self.engine.generate(**scoring_request(sequences)))

    def _push(self, state: dict[str, Tensor]) -> None:
        success, message = self.engine.update_weights_from_tensor(named_tensors=list(state.items()), flush_cache=True)
        if not success:
            raise RuntimeError(f"rollout.backend=sglang: the weight sync failed: {message}")

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            del self.engine
