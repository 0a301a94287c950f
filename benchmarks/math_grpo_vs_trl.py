"""Math GRPO side by side with TRL's ``GRPOTrainer``, in one run: the same warm-started tiny
Llama-shaped model and tokenizer, the same arithmetic prompts, group size, batch (prompts x
group responses, one optimizer step of all of them per training step), max_new_tokens,
learning rate (constant), Adam settings, loss (token mean, no KL), reward (the same math-verify
scorer, +1 / -1) and number of steps. Prints the median step time of each and their ratio, and
the held-out greedy accuracy of each after the same steps. Ours runs twice: synchronous, and one
step off-policy (``algorithm.staleness_threshold=1``, decoupled PPO loss). Our step time is the
runner's ``time/step`` (rollout wait + update + sync, evals excluded).

    python benchmarks/math_grpo_vs_trl.py [--out results/math_vs_trl] [--steps 60]

TRL is a benchmarks-only extra (``pip install -e .[trl]``). Both sides use the 2 CPU cores: TRL
in one process with 2 torch threads, ours as its env, rollout and actor workers on 2 CPU slots.
With one update per batch TRL takes the old log-probs of the ratio from the policy being
trained (no extra pass); ours takes them from the rollout (``rollout.recompute_logprobs=false``),
made by the same weights.

It also times one step's work alone, one thread per piece (sampling, forward + backward + Adam,
scoring): half their sum is a lower bound on the step time of anything that spreads that work
over the 2 cores, printed as ``floor_vs_trl``. The last line is JSON with ``step_time_vs_trl``
(ours / TRL), ``async_step_time_vs_trl``, ``floor_vs_trl``, ``accuracy_ours``, ``accuracy_trl``.

``--model qwen2_65m``: the generation engines at a size where the model's compute counts
(issue 19): the 65M Qwen2-shaped model of ``benchmarks/generation.py`` with random weights and the
same character tokenizer, ``--new-tokens`` (32) per response, ours with ``rollout.backend=vllm``
and with ``huggingface``, against TRL generating with Hugging Face ``generate`` (TRL's own vLLM
modes load weights through ``model.load_weights``, which the CPU build of vLLM refuses:
``../shared/notes/vllm.md``). Random weights answer nothing right, so every reward is -1 and the
accuracies are 0: this measures step time only. The JSON line holds ``step_time_vs_trl`` (vLLM /
TRL) and ``hf_step_time_vs_trl``.

    python benchmarks/math_grpo_vs_trl.py --model qwen2_65m [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, GROUP, NEW_TOKENS, LR = 32, 8, 4, 1e-3  # NEW_TOKENS: the tiny model's
# ours, synchronous (rollout, then update) and one step off-policy (the next rollout runs while the
# actor updates; decoupled PPO loss against the proximal policy)
MODES = {"sync": [],
         "async": ["algorithm.staleness_threshold=1", "algorithm.loss_type=decoupled_actor_critic"]}
# the 65M model: our two generation backends (each rollout rank holds an engine of one thread)
ENGINES = {"vllm": ["rollout.backend=vllm", f"rollout.max_running_requests={PROMPTS * GROUP // 4}"],
           "huggingface": []}


def run_trl(model_dir: Path, data_dir: Path, out: Path, steps: int, new_tokens: int = NEW_TOKENS) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.verifier import Verifier
    from envs.arithmetic import greedy_accuracy, read_jsonl

    torch.set_num_threads(2)
    verifier = Verifier()

    def reward(completions, answer, **_):
        return [1.0 if ok else -1.0 for ok in verifier.score(completions, answer).correct]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.tic = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.tic)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    train = read_jsonl(data_dir / "train.jsonl")
    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, max_completion_length=new_tokens, learning_rate=LR, lr_scheduler_type="constant",
        adam_epsilon=1e-5, max_grad_norm=1.0, beta=0.0, loss_type="dapo", scale_rewards="group",
        temperature=1.0, num_iterations=1, use_cpu=True, bf16=False, gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True)
    times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(train), callbacks=[times])
    tic = time.monotonic()
    trainer.train()
    wall = time.monotonic() - tic
    accuracy = greedy_accuracy(trainer.model, tokenizer, read_jsonl(data_dir / "test.jsonl"), new_tokens)
    verifier.close()
    return {"step_s": statistics.median(times.times[1:]), "accuracy": accuracy, "wall_s": wall}


def measure_floor(model_dir: Path, data_dir: Path, repeats: int = 7) -> dict[str, float]:
    """The work of one training step, each piece alone on one thread in this process: sampling
    the batch (KV cache), one forward + backward + Adam step over it, scoring it. Whatever
    splits that work over the machine's 2 cores, with no overhead at all, needs at least half
    their sum per step: a lower bound for any implementation of this step on this machine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs.verifier import Verifier
    from envs.arithmetic import read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-5)
    rows = read_jsonl(data_dir / "train.jsonl")
    verifier = Verifier()
    times: dict[str, list[float]] = {"generate": [], "train": [], "score": []}
    for r in range(repeats):
        batch = [row for row in rows[r * PROMPTS:(r + 1) * PROMPTS] for _ in range(GROUP)]
        prompts = tokenizer([row["prompt"] for row in batch], return_tensors="pt", padding=True)
        tic = time.perf_counter()
        with torch.no_grad():
            ids = model.generate(**prompts, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        times["generate"].append(time.perf_counter() - tic)
        width = prompts["input_ids"].shape[1]
        mask = torch.cat([prompts["attention_mask"], torch.ones_like(ids[:, width:])], dim=1)
        tic = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, width - 1:-1]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, width:, None])
        logprobs.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        times["train"].append(time.perf_counter() - tic)
        texts = tokenizer.batch_decode(ids[:, width:], skip_special_tokens=True)
        tic = time.perf_counter()
        verifier.score(texts, [row["answer"] for row in batch])
        times["score"].append(time.perf_counter() - tic)
    verifier.close()
    parts = {k: statistics.median(v[1:]) for k, v in times.items()}
    return parts | {"floor_s": sum(parts.values()) / 2}


def run_ours(model_dir: Path, data_dir: Path, out: Path, steps: int, name: str, extra: list[str],
             new_tokens: int = NEW_TOKENS) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = [sys.executable, "-m", "embodied", "train", "--config-name", "math_grpo_tiny",
               f"actor.model.model_path={model_dir}", f"data.train_data_paths=[{data_dir / 'train.jsonl'}]",
               f"data.val_data_paths=[{data_dir / 'test.jsonl'}]", f"runner.output_dir={out}",
               f"runner.experiment_name={name}", f"runner.max_epochs={steps}", f"runner.val_check_interval={steps}",
               "runner.val_before_train=false", f"data.rollout_batch_size={PROMPTS}", f"algorithm.group_size={GROUP}",
               f"runner.seq_length={8 + new_tokens}", "data.max_prompt_length=8", f"actor.optim.lr={LR}",
               "actor.lr_sched.lr_decay_style=constant", f"actor.global_batch_size={PROMPTS * GROUP}",
               "algorithm.update_epochs=1", "algorithm.kl_beta=0", "algorithm.loss_agg_func=token-mean",
               "algorithm.sampling_params.temperature=1.0", "reward.reward_scale=1.0",
               "rollout.recompute_logprobs=false", *extra]
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if done.returncode:
        sys.exit(f"our run failed: {' '.join(command)}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    events = EventAccumulator(str(out / name / "tensorboard"))
    events.Reload()
    parts = {tag.split("/")[1]: {e.step: e.value for e in events.Scalars(tag)}
             for tag in ("time/step", "time/sync", "time/rollout", "time/update", "time/overlap")}
    phases = {tag: statistics.median(v for s, v in p.items() if s > 1) for tag, p in parts.items()}
    return {"step_s": phases.pop("step"), "accuracy": result["eval_success"], "wall_s": result["wall_s"],
            "phases": phases}


def engines_at_65m(out: Path, steps: int, new_tokens: int) -> None:
    """Step time of ours with vLLM and with HF ``generate`` against TRL's, on the random 65M model."""
    from benchmarks.generation import write_model
    from envs.arithmetic import write_split

    write_split(out / "data")
    params = write_model("qwen2_65m", out / "model")
    print(f"qwen2_65m: {params / 1e6:.1f}M parameters, random weights; {new_tokens} new tokens", flush=True)
    small = ["actor.micro_batch_size=32", "algorithm.logprob_forward_micro_batch_size=32"]
    ours = {}
    for engine, extra in ENGINES.items():
        ours[engine] = run_ours(out / "model", out / "data", out, steps, f"ours_{engine}", extra + small, new_tokens)
        print(f"ours, {engine}: median step {ours[engine]['step_s']:.3f} s ("
              + ", ".join(f"{k} {v:.3f}" for k, v in ours[engine]["phases"].items()) + ")", flush=True)
    trl = run_trl(out / "model", out / "data", out, steps, new_tokens)
    print(f"TRL (HF generate): median step {trl['step_s']:.3f} s", flush=True)
    print(json.dumps({"model": "qwen2_65m", "params_m": round(params / 1e6, 1), "new_tokens": new_tokens,
                      "step_time_vs_trl": round(ours["vllm"]["step_s"] / trl["step_s"], 3),
                      "hf_step_time_vs_trl": round(ours["huggingface"]["step_s"] / trl["step_s"], 3),
                      "step_s_vllm": round(ours["vllm"]["step_s"], 3), "step_s_hf": round(ours["huggingface"]["step_s"], 3),
                      "step_s_trl": round(trl["step_s"], 3), "phases_vllm": ours["vllm"]["phases"],
                      "phases_hf": ours["huggingface"]["phases"], "accuracy_vllm": ours["vllm"]["accuracy"],
                      "accuracy_hf": ours["huggingface"]["accuracy"], "accuracy_trl": trl["accuracy"],
                      "steps": steps, "prompts": PROMPTS, "group_size": GROUP}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: results/math_vs_trl (results/math_vs_trl_65m)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of each run (default 60; 6 at 65M)")
    parser.add_argument("--model", choices=["tiny", "qwen2_65m"], default="tiny")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per response at 65M")
    args = parser.parse_args()
    if args.model == "qwen2_65m":
        engines_at_65m(Path(args.out or ROOT / "results" / "math_vs_trl_65m"), args.steps or 6, args.new_tokens)
        return
    out = Path(args.out or ROOT / "results" / "math_vs_trl")
    args.steps = args.steps or 60

    import torch

    from envs.arithmetic import held_out_accuracy, write_split
    from policies.tiny_lm import warm_start

    torch.set_num_threads(1)  # a tiny model: more threads only contend
    write_split(out / "data")
    warm_start(out / "model", out / "data")
    warm = {"accuracy": held_out_accuracy(out / "model", out / "data")}
    print(f"warm start: held-out greedy accuracy {warm['accuracy']:.3f}", flush=True)
    floor = measure_floor(out / "model", out / "data")
    print("one step's work, one thread each: " + ", ".join(f"{k} {v:.3f} s" for k, v in floor.items() if k != "floor_s")
          + f"; on 2 cores at least {floor['floor_s']:.3f} s per step", flush=True)
    ours = {}
    for mode, extra in MODES.items():
        ours[mode] = run_ours(out / "model", out / "data", out, args.steps, f"ours_{mode}", extra)
        print(f"ours, {mode}: median step {ours[mode]['step_s']:.3f} s ("
              + ", ".join(f"{k} {v:.3f}" for k, v in ours[mode]["phases"].items())
              + f"), accuracy {ours[mode]['accuracy']:.3f} after {args.steps} steps", flush=True)
    trl = run_trl(out / "model", out / "data", out, args.steps)
    print(f"TRL:  median step {trl['step_s']:.3f} s, accuracy {trl['accuracy']:.3f} after {args.steps} steps", flush=True)
    ratios = {mode: ours[mode]["step_s"] / trl["step_s"] for mode in MODES}
    print("step time ours / TRL: " + ", ".join(f"{mode} {r:.2f}x" for mode, r in ratios.items())
          + f"; the 2-core bound / TRL: {floor['floor_s'] / trl['step_s']:.2f}x")
    print(json.dumps({"step_time_vs_trl": round(ratios["sync"], 3), "async_step_time_vs_trl": round(ratios["async"], 3),
                      "floor_vs_trl": round(floor["floor_s"] / trl["step_s"], 3), "floor_s": round(floor["floor_s"], 4),
                      "step_s_ours": round(ours["sync"]["step_s"], 4), "step_s_ours_async": round(ours["async"]["step_s"], 4),
                      "step_s_trl": round(trl["step_s"], 4), "accuracy_ours": ours["sync"]["accuracy"],
                      "accuracy_ours_async": ours["async"]["accuracy"], "accuracy_trl": trl["accuracy"],
                      "accuracy_start": warm["accuracy"], "steps": args.steps, "prompts": PROMPTS, "group_size": GROUP,
                      "max_new_tokens": NEW_TOKENS, "lr": LR}))

if __name__ == "__main__":
    main()
