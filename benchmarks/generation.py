"""Rollout generation throughput: vLLM against Hugging Face ``generate``, on the same model and
prompts, through the framework's two rollout policies (``VLLMCausalLM.act`` and
``CausalLMPolicy.act``: sampled responses with per-token log-probs, response masks, padding).

Batch of 256 rows as the text env sends them (32 prompts x groups of 8), sampling at
temperature 1, ``min_new_tokens = max_new_tokens`` so that both sides generate exactly the same
number of tokens (random weights would otherwise end responses at random). Both in fp32
(``--precision bf16``: both in bf16), on ``--threads`` CPU threads. Models, random weights, built
on the spot:

- ``tiny``: the tiny math model's shape (``policies/tiny_lm.py``: Llama, 2 layers of width 128,
  character vocabulary);
- ``qwen2_65m``: Qwen2-shaped, 16 layers of width 512, 8 query / 2 key-value heads, MLP 2048,
  vocabulary 8192 (65M parameters);
- ``qwen2_91m``: the same vocabulary, wider and shallower: 10 layers of width 768, 12 query / 2
  key-value heads, MLP 3072 (91M parameters).

Also measured on each: one weight sync (the actor's full state into the running engine) and
one sync check (``verify_sync`` on an 8-row probe, the engine's side). With ``--lora``, the
65M model with rank-8 LoRA on every projection: generation through vLLM's own LoRA support
against merged weights, and the cost of each per step.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/generation.py [--new-tokens 64] [--repeats 3] [--lora]
        [--precision bf16] [--compile]

Each row also has a ceiling: the time this CPU needs for the matrix products of one decode step
alone (every ``Linear`` of the model, the LM head included, on the batch's 256 rows, timed here
with ``torch`` on the same threads and dtype), turned into tokens/s. No engine can generate
faster than that, so ``ceiling_vs_hf`` bounds the ratio any engine could reach over ``generate``
on this machine; ``vllm_of_ceiling`` is how close vLLM comes.

The last line is JSON with ``vllm_vs_hf_tokens_per_s`` and ``ceiling_vs_hf`` per model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies.causal_lm import CausalLMPolicy  # noqa: E402
from policies.engines.probe import ProbeBatch  # noqa: E402
from policies.tiny_lm import build_model, train_tokenizer  # noqa: E402
from policies.weights import DTYPES  # noqa: E402

PROMPTS, GROUP, PROMPT_TOKENS = 32, 8, 16
MODELS = {
    "tiny": None,  # policies.tiny_lm.build_model
    "qwen2_65m": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=16, num_attention_heads=8,
                      num_key_value_heads=2, intermediate_size=2048),
    "qwen2_91m": dict(vocab_size=8192, hidden_size=768, num_hidden_layers=10, num_attention_heads=12,
                      num_key_value_heads=2, intermediate_size=3072),
}


def write_model(name: str, folder: Path) -> int:
    """A random-weight checkpoint folder with a character tokenizer; returns the parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(["0123456789+-*/= abcdefghijklmnopqrstuvwxyz"])
    torch.manual_seed(0)
    if MODELS[name] is None:
        model = build_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
        model.config.max_position_embeddings = 256
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**MODELS[name], max_position_embeddings=256, tie_word_embeddings=True,
                                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                             bos_token_id=None))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def model_cfg(folder: Path, new_tokens: int, **over) -> dict:
    cfg = dict(model_type="causal_lm", model_path=str(folder), action_dim=new_tokens, num_action_chunks=1,
               value_type="chunk_level", max_prompt_length=PROMPT_TOKENS, add_value_head=False, do_sample=True,
               temperature=1.0, top_k=-1, top_p=1.0, repetition_penalty=1.0, min_new_tokens=new_tokens, stop=None,
               tokenizer_model=None, tokenizer_use_fast=True, tokenizer_trust_remote_code=False, eos_token_id=None,
               pad_token_id=None, precision="fp32", is_lora=False, lora_rank=8, lora_path=None,
               attn_implementation="sdpa", trust_remote_code=False, low_cpu_mem_usage=True,
               gradient_checkpointing=False)
    cfg.update(over)
    return cfg


def observations(vocab: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, vocab, (PROMPTS, PROMPT_TOKENS), generator=generator)
    ids = prompts.repeat_interleave(GROUP, dim=0)
    return {"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy()}


def tokens_per_s(policy, obs: dict, repeats: int) -> float:
    """Median generated tokens per second of ``policy.act`` after one warm-up call."""
    policy.act(obs)
    rates = []
    for seed in range(repeats):
        torch.manual_seed(seed)
        tic = time.perf_counter()
        out = policy.act(obs)
        rates.append(float(out.token_mask.sum()) / (time.perf_counter() - tic))
    return statistics.median(rates)


def ceiling_tokens_per_s(model: torch.nn.Module, rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Tokens/s if a decode step cost only its matrix products: each distinct ``Linear`` shape
    timed on ``rows`` inputs, times how often the model has it (attention over the short context,
    norms and sampling are left out, so the bound is generous)."""
    counts = Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))
    step_s = sum(count * fastest_product_s(torch.randn(rows, fan_in, dtype=dtype),
                                           torch.randn(fan_in, fan_out, dtype=dtype), repeats)
                 for (fan_in, fan_out), count in counts.items())
    return rows / step_s


def fastest_product_s(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    x @ w  # warm-up
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - tic)
    return min(times)


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def measure(name: str, root: Path, args: argparse.Namespace) -> dict:
    from policies.engines.vllm import VLLMCausalLM

    folder = root / name
    params = write_model(name, folder)
    cfg = model_cfg(folder, args.new_tokens, precision=args.precision)
    rollout = {"enforce_eager": not args.compile, "max_running_requests": PROMPTS * GROUP}
    torch.set_num_threads(args.threads)
    hf = CausalLMPolicy(cfg)
    ceiling = ceiling_tokens_per_s(hf.model, PROMPTS * GROUP, DTYPES[args.precision])
    obs = observations(hf.model.config.vocab_size)
    tic = time.perf_counter()
    engine = VLLMCausalLM(cfg, rollout, cpu_threads=args.threads)
    start_s = time.perf_counter() - tic
    vllm_rate = tokens_per_s(engine, obs, args.repeats)
    hf_rate = tokens_per_s(hf, obs, args.repeats)
    state = hf.trainable_state_dict()
    sync_s = median_s(lambda: engine.load_trainable_state_dict(state), args.repeats)
    probe = ProbeBatch.from_rollout(engine.act(obs))
    actor = hf.probe_logprobs(probe.forward_inputs, probe.actions)
    verify_s = median_s(lambda: engine.verify_sync(probe.forward_inputs, probe.actions, actor, step=0), args.repeats)
    actor_probe_s = median_s(lambda: hf.probe_logprobs(probe.forward_inputs, probe.actions), args.repeats)
    engine.shutdown()
    row = {"model": name, "params_m": round(params / 1e6, 1), "vllm_tokens_per_s": round(vllm_rate),
           "hf_tokens_per_s": round(hf_rate), "ratio": round(vllm_rate / hf_rate, 2),
           "ceiling_tokens_per_s": round(ceiling), "ceiling_vs_hf": round(ceiling / hf_rate, 2),
           "vllm_of_ceiling": round(vllm_rate / ceiling, 2),
           "engine_start_s": round(start_s, 1), "sync_s": round(sync_s, 3), "verify_engine_s": round(verify_s, 3),
           "verify_actor_s": round(actor_probe_s, 3),
           "rollout_s": round(PROMPTS * GROUP * args.new_tokens / vllm_rate, 2)}
    print(f"{name:>10} {row['params_m']:>6}M  vLLM {vllm_rate:8.0f} tok/s  HF {hf_rate:8.0f} tok/s  "
          f"{row['ratio']:.2f}x  (ceiling {ceiling:.0f} tok/s: {row['ceiling_vs_hf']:.2f}x HF)  start {start_s:.1f} s  "
          f"sync {sync_s:.3f} s  check {verify_s:.3f} + "
          f"{actor_probe_s:.3f} s (engine + actor) vs rollout {row['rollout_s']} s", flush=True)
    return row


def measure_lora(root: Path, args: argparse.Namespace) -> dict:
    """vLLM's own LoRA (adapters loaded per step) against merged weights, 65M model, rank 8."""
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from policies.engines.vllm import VLLMCausalLM

    folder = root / "qwen2_65m"
    if not folder.exists():
        write_model("qwen2_65m", folder)
    cfg = model_cfg(folder, args.new_tokens, is_lora=True)
    actor = CausalLMPolicy(cfg)
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    state = actor.trainable_state_dict()
    obs = observations(actor.model.config.vocab_size)
    merged = VLLMCausalLM(cfg, {"enforce_eager": True, "max_running_requests": PROMPTS * GROUP},
                          cpu_threads=args.threads)
    merged_sync = median_s(lambda: merged.load_trainable_state_dict(state), args.repeats)
    merged_rate = tokens_per_s(merged, obs, args.repeats)
    merged.shutdown()

    adapter = root / "adapter"
    actor.model.save_pretrained(adapter)  # peft's folder: what a per-step LoRA load reads
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              generation_config="vllm", max_model_len=PROMPT_TOKENS + args.new_tokens, max_num_seqs=PROMPTS * GROUP,
              kv_cache_memory_bytes=2 << 30, enable_lora=True, max_lora_rank=8, max_loras=1)
    prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for p in torch.as_tensor(obs["input_ids"])[::GROUP]]
    params = SamplingParams(n=GROUP, max_tokens=args.new_tokens, min_tokens=args.new_tokens, logprobs=0,
                            detokenize=False)
    step = [0]

    def lora_sync() -> None:  # a new adapter version every step: written, then loaded under a new id
        step[0] += 1
        save_file({k.removeprefix("model.").replace(".default.", "."): v for k, v in state.items()},
                  str(adapter / "adapter_model.safetensors"))
        llm.llm_engine.add_lora(LoRARequest(f"step{step[0]}", step[0], str(adapter)))
        if step[0] > 1:
            llm.llm_engine.remove_lora(step[0] - 1)

    lora_sync_s = median_s(lora_sync, args.repeats)
    request = LoRARequest(f"step{step[0]}", step[0], str(adapter))
    llm.generate(prompts, params, lora_request=request, use_tqdm=False)
    rates = []
    for _ in range(args.repeats):
        tic = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        rates.append(sum(len(o.token_ids) for r in outs for o in r.outputs) / (time.perf_counter() - tic))
    lora_rate = statistics.median(rates)
    row = {"merged_tokens_per_s": round(merged_rate), "vllm_lora_tokens_per_s": round(lora_rate),
           "merged_sync_s": round(merged_sync, 3), "vllm_lora_sync_s": round(lora_sync_s, 3),
           "merged_vs_vllm_lora": round(merged_rate / lora_rate, 2)}
    print(f"LoRA rank 8, 65M: merged {merged_rate:.0f} tok/s (sync {merged_sync:.3f} s)  vLLM LoRA "
          f"{lora_rate:.0f} tok/s (sync {lora_sync_s:.3f} s)  merged / LoRA {row['merged_vs_vllm_lora']:.2f}x")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="both engines' dtype")
    parser.add_argument("--compile", action="store_true", help="vLLM with enforce_eager false (compiled graphs)")
    parser.add_argument("--lora", action="store_true", help="also vLLM's LoRA against merged weights (65M model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, Path(tmp), args) for name in args.models]
        lora = measure_lora(Path(tmp), args) if args.lora else None
    print(json.dumps({
        "benchmark": "generation", "batch": PROMPTS * GROUP, "new_tokens": args.new_tokens, "threads": args.threads,
        "precision": args.precision, "vllm_compiled": args.compile,
        "rows": rows, "lora": lora,
        "vllm_vs_hf_tokens_per_s": {row["model"]: row["ratio"] for row in rows},
        "ceiling_vs_hf": {row["model"]: row["ceiling_vs_hf"] for row in rows},
    }))


if __name__ == "__main__":
    main()
