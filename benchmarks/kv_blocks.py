"""The KV cache block of the vLLM engine on a CPU: vLLM's CPU default of 128 tokens against the
framework's (``policies/engines/vllm.py``, ``CPU_BLOCK``: 32, the smallest block vLLM's CPU
attention takes).

The prefix cache reuses whole blocks only, so each turn of an episode recomputes the tokens after
its last full block. This runs the kept side of ``agent_rollout.py`` (64 episodes of 4 turns, a
256-token prompt, 32 generated and 160 observed tokens a turn, the 65M Qwen2 shape, greedy) on an
engine of each block size in turn, ``--repeats`` times (a fresh engine each time), and reports per
block the tokens prefilled per episode (the engine's own count of cached prompt tokens) and the
median wall time of turns 2-4, where the prefix cache is in play. The math runs' shape is timed on
the same engines: one turn of 32 prompts of 48 tokens, 8 samples each (seeded), 64 new tokens
(decoded 64 at a time, the engines' ``max_running_requests`` here); a group's samples share the
prompt's full blocks through the same prefix cache. And the prefill of prompts seen for the first
time (the re-encoded side's work in ``agent_rollout.py``): 64 prompts of 448 tokens, one new
token each, the prefix cache emptied first.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/kv_blocks.py [--repeats 3]

The last line is JSON with each block's ``prefilled_tokens``, ``turns_2_4_s``, ``single_turn_s``
and ``fresh_prefill_s``, and ``ratio``, ``single_turn_ratio`` and ``fresh_prefill_ratio`` (128's
time over ``CPU_BLOCK``'s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agent_rollout import EPISODES, OBSERVATION, PROMPT, RESPONSE, TURNS, width, write_model  # noqa: E402
from benchmarks.generation import model_cfg  # noqa: E402
import policies.engines.vllm as vllm_engine  # noqa: E402

BLOCKS = (128, vllm_engine.CPU_BLOCK)


def warm_up(llm) -> None:
    """The first generate of an engine pays one-time costs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(range(2, 100))) for _ in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)


def rollout(llm, vocab: int, rng: np.random.Generator) -> tuple[int, float]:
    """Tokens prefilled per episode, and seconds of turns 2-4."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=RESPONSE, min_tokens=RESPONSE, temperature=0.0, ignore_eos=True,
                            detokenize=False, logprobs=0)
    sequences = [rng.integers(2, vocab, PROMPT).tolist() for _ in range(EPISODES)]
    prefilled, later = 0, 0.0
    for turn in range(TURNS):
        tic = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        if turn:
            later += time.perf_counter() - tic
        prefilled += sum(len(s) - (o.num_cached_tokens or 0) for s, o in zip(sequences, outputs))
        sequences = [s + list(o.outputs[0].token_ids) + rng.integers(2, vocab, OBSERVATION).tolist()
                     for s, o in zip(sequences, outputs)]
    return prefilled // EPISODES, later


def single_turn(llm, vocab: int, rng: np.random.Generator) -> float:
    """Seconds of one math-shaped rollout: short prompts, groups of sampled responses."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=rng.integers(2, vocab, 48).tolist()) for _ in range(32)]
    params = [SamplingParams(n=8, max_tokens=64, min_tokens=64, temperature=1.0, ignore_eos=True, detokenize=False,
                             logprobs=0, seed=row) for row in range(32)]
    tic = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - tic


def fresh_prefill(llm, vocab: int, rng: np.random.Generator) -> float:
    """Seconds to prefill prompts that nothing in the cache shares: the block's cost without its reuse."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    length = PROMPT + RESPONSE + OBSERVATION
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(2, vocab, length).tolist()) for _ in range(EPISODES)]
    llm.reset_prefix_cache()
    tic = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    figures: dict[int, dict] = {block: {"prefilled_tokens": None, "times": [], "single": [], "fresh": []}
                                for block in BLOCKS}
    with tempfile.TemporaryDirectory() as root:
        tokenizer = write_model(Path(root))
        cfg = model_cfg(Path(root), RESPONSE, max_prompt_length=width(PROMPT))
        for repeat in range(args.repeats):
            for block in BLOCKS:
                vllm_engine.CPU_BLOCK = block
                engine = vllm_engine.VLLMCausalLM(cfg, {"enforce_eager": True, "max_running_requests": EPISODES},
                                                  cpu_threads=args.threads)
                assert engine.llm.llm_engine.vllm_config.cache_config.block_size == block
                warm_up(engine.llm)
                prefilled, seconds = rollout(engine.llm, len(tokenizer), np.random.default_rng(repeat))
                single = single_turn(engine.llm, len(tokenizer), np.random.default_rng(repeat))
                fresh = fresh_prefill(engine.llm, len(tokenizer), np.random.default_rng(repeat))
                engine.shutdown()
                figures[block]["prefilled_tokens"] = prefilled
                figures[block]["times"].append(seconds)
                figures[block]["single"].append(single)
                figures[block]["fresh"].append(fresh)
                print(f"repeat {repeat}: block {block}: {prefilled} tokens prefilled per episode, turns 2-4 in "
                      f"{seconds:.1f} s; single turn in {single:.1f} s; fresh prefill in {fresh:.1f} s", flush=True)
    result = {f"block_{block}": {"prefilled_tokens": f["prefilled_tokens"],
                                 "turns_2_4_s": round(statistics.median(f["times"]), 1),
                                 "single_turn_s": round(statistics.median(f["single"]), 1),
                                 "fresh_prefill_s": round(statistics.median(f["fresh"]), 1)}
              for block, f in figures.items()}
    old, new = (result[f"block_{block}"] for block in BLOCKS)
    result["ratio"] = round(old["turns_2_4_s"] / new["turns_2_4_s"], 2)
    result["single_turn_ratio"] = round(old["single_turn_s"] / new["single_turn_s"], 2)
    result["fresh_prefill_ratio"] = round(old["fresh_prefill_s"] / new["fresh_prefill_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
