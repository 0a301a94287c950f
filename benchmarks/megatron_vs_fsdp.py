"""Actor update (one optimizer step of a global batch) with the Megatron-Core backend at tensor
parallel 2 against FSDP2 (``fully_shard``) over the same 2 ranks: median step time and peak
memory, on the tiny math model and on a ~75M-parameter Llama built from a config.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/megatron_vs_fsdp.py [--steps 5] [--out DIR]

Both run the actor's step on the causal LM: forward through ``evaluate`` (per-token log-probs and
entropy), a policy-gradient loss, backward in micro-batches of ``micro`` samples, the gradient
sync, the grad-norm clip (1.0) and an Adam step. FSDP2 is data parallel (each rank half of the
global batch, the causal LM policy sharded layer by layer, as the actor shards it); Megatron is
tensor parallel (each rank the whole batch, half of every layer; data parallel size 1).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the steps; on CPU the largest
resident set size sampled every 2 ms during the steps, minus the resident set just before them
(what the update adds on top of the built model), the larger of the two ranks. The last line is
JSON with ``megatron_vs_fsdp_step_time`` (Megatron / FSDP2 median step time on the ~75M model,
or on the first of ``--models``; > 1 means Megatron is slower) and every figure, with the device
named.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# model name -> (global batch, micro-batch per forward, prompt tokens, response tokens)
WORKLOADS = {"tiny_math": (256, 128, 8, 4),  # config/math_grpo_tiny.yaml's actor batch
             "llama_75m": (8, 4, 64, 64)}


def make_models(folder: Path) -> dict[str, Path]:
    """The tiny math model (``policies.tiny_lm``'s shape and tokenizer, random weights: step time
    does not depend on them) and a ~75M Llama (hidden 768, 8 layers, vocabulary 32000, tied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from envs.arithmetic import make_problems
    from policies.tiny_lm import build_model, train_tokenizer

    tokenizer = train_tokenizer([p["prompt"] + p["answer"] for p in make_problems(2000, 0)])
    vocab = len(tokenizer) + len(tokenizer) % 2  # tensor parallel 2 splits the vocabulary in halves
    paths = {"tiny_math": folder / "tiny_math", "llama_75m": folder / "llama_75m"}
    build_model(vocab, tokenizer.pad_token_id, tokenizer.eos_token_id).save_pretrained(paths["tiny_math"])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )).save_pretrained(paths["llama_75m"])
    for path in paths.values():
        tokenizer.save_pretrained(path)
    return paths


def policy_cfg(path: Path, response: int, prompt: int, **over) -> dict:
    cfg = dict(model_type="causal_lm", model_path=str(path), action_dim=response, num_action_chunks=1,
               value_type="chunk_level", max_prompt_length=prompt, add_value_head=False, do_sample=True,
               temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, min_new_tokens=1, stop=None,
               tokenizer_model=None, tokenizer_use_fast=True, tokenizer_trust_remote_code=False, eos_token_id=None,
               pad_token_id=None,
               precision="fp32", is_lora=False, lora_rank=4, lora_path=None, attn_implementation="sdpa",
               trust_remote_code=False, low_cpu_mem_usage=True, gradient_checkpointing=False)
    cfg.update(over)
    return cfg


def make_batch(size: int, prompt: int, response: int, vocab: int):
    """Left-padded prompts and responses with response masks of varied length (fixed seed)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (size, prompt), generator=g)
    mask = torch.ones_like(ids)
    response_mask = torch.ones(size, response)
    for row in range(size):
        pad = int(torch.randint(0, prompt // 2, (1,), generator=g))
        ids[row, :pad], mask[row, :pad] = 0, 0
        response_mask[row, response - int(torch.randint(0, response // 2, (1,), generator=g)):] = 0
    actions = torch.randint(2, vocab, (size, 1, response), generator=g)
    advantages = torch.randn(size, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask}, actions, advantages


class PeakRSS:
    """The largest resident set size of this process while running (sampled by a thread)."""

    def __enter__(self):
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.start = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()


def _rank(rank: int, backend: str, path: str, workload: tuple, steps: int, port: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # two ranks on two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    size, micro, prompt, response = workload
    cfg = policy_cfg(Path(path), response, prompt)
    if backend == "megatron":
        from policies.megatron.policy import MegatronCausalLMPolicy

        policy = MegatronCausalLMPolicy({**cfg, "tensor_model_parallel_size": 2})
        share = slice(0, size)  # tensor parallel: both ranks compute the whole batch

        def sync_and_clip() -> float:
            policy.reduce_gradients()
            return policy.clip_grad_norm(1.0)
    else:
        from torch.distributed.fsdp import fully_shard

        from policies.causal_lm import CausalLMPolicy

        policy = CausalLMPolicy(cfg)
        for unit in policy.shard_units():
            fully_shard(unit)
        fully_shard(policy)
        share = slice(rank * size // 2, (rank + 1) * size // 2)  # data parallel: half the batch each

        def sync_and_clip() -> float:  # FSDP2 reduce-scattered the gradients in backward
            norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    vocab = policy.arch.vocab_size if backend == "megatron" else policy.model.config.vocab_size
    forward_inputs, actions, advantages = make_batch(size, prompt, response, vocab)
    forward_inputs = {k: v[share] for k, v in forward_inputs.items()}
    actions, advantages = actions[share], advantages[share]
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-5)
    policy.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        parts = list(torch.arange(actions.shape[0]).split(micro))
        for part in parts:
            out = policy({k: v[part] for k, v in forward_inputs.items()}, actions[part])
            mask = forward_inputs["response_mask"][part][:, None]
            loss = -(out.logprobs * advantages[part, None, None] * mask).sum() / mask.sum()
            (loss / len(parts)).backward()
        sync_and_clip()
        optimizer.step()

    step()  # warm-up
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as memory:
        for _ in range(steps):
            dist.barrier()
            tic = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - tic)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else memory.peak - memory.start) / 2**20
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in policy.parameters())
    Path(out, f"{rank}.json").write_text(json.dumps({"times": times, "peak_mb": peak, "local_params": params}))
    dist.destroy_process_group()


def run(backend: str, path: Path, workload: tuple, steps: int) -> dict:
    """One backend on 2 spawned ranks: median step time (s), peak memory (MiB, larger rank)."""
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        context = multiprocessing.get_context("spawn")
        procs = [context.Process(target=_rank, args=(r, backend, str(path), workload, steps, port, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
        if any(p.exitcode != 0 for p in procs):
            for p in procs:
                p.kill()
            raise RuntimeError(f"{backend} on {path.name}: a rank failed ({[p.exitcode for p in procs]})")
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    times = [max(pair) for pair in zip(*(r["times"] for r in ranks))]
    return {"step_s": statistics.median(times), "peak_mb": max(r["peak_mb"] for r in ranks),
            "params_per_rank": ranks[0]["local_params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per backend (after one warm-up)")
    parser.add_argument("--out", default=None, help="folder for the generated models (default: a temporary one)")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores), gloo"
    with tempfile.TemporaryDirectory() as scratch:
        paths = make_models(Path(args.out or scratch))
        results: dict[str, dict] = {}
        print(f"device: {device}; {args.steps} timed steps after one warm-up")
        print(f"{'model':>10} {'backend':>9} {'step (s)':>9} {'peak (MiB)':>11} {'params/rank':>12}")
        for name in args.models:
            path = paths[name]
            for backend in ("fsdp2", "megatron"):
                r = results.setdefault(name, {})[backend] = run(backend, path, WORKLOADS[name], args.steps)
                print(f"{name:>10} {backend:>9} {r['step_s']:9.3f} {r['peak_mb']:11.1f} {r['params_per_rank']:12d}",
                      flush=True)
            results[name]["step_time_ratio"] = results[name]["megatron"]["step_s"] / results[name]["fsdp2"]["step_s"]
            print(f"{name}: megatron / fsdp2 step time {results[name]['step_time_ratio']:.2f}x")
    headline = results["llama_75m" if "llama_75m" in results else args.models[0]]["step_time_ratio"]
    print(json.dumps({"device": device, "megatron_vs_fsdp_step_time": headline,
                      "workloads": {k: dict(zip(("global_batch", "micro_batch", "prompt", "response"), v))
                                    for k, v in WORKLOADS.items()}, **results}))


if __name__ == "__main__":
    main()
