"""The math learning bar in one command on a fresh checkout: make the arithmetic prompt set, build
and warm-start the tiny Llama-shaped model, train ``math_grpo_tiny`` through the real pipeline,
and print the held-out greedy accuracy curve (time, step, accuracy, training reward, response
length) and the start/end accuracies.

    python benchmarks/math_learning.py [--out results/math_learning] [--steps 1000] [--val-every 100]
        [--config math_grpo_tiny_vllm] [overrides...]

The baseline is the warm-start checkpoint itself (validation before the first step); the last
line is JSON with ``accuracy_start``, ``accuracy_end``, ``train_wall_s`` (the whole training
command: Ray start, every validation and the final checkpoint included) and the curve.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def curve(log_dir: Path) -> list[dict[str, float]]:
    """One row per validation: seconds since the first, step, accuracy, and the training reward
    and response length of that step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    accuracy = events.Scalars("eval/success_once")
    train = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in ("train/return", "train/length")}
    start = accuracy[0].wall_time
    def at(tag: str, step: int) -> float | None:  # the validation before training has no training step
        value = train[tag].get(step)
        return None if value is None else round(value, 3)

    return [{"time_s": round(e.wall_time - start, 1), "step": e.step, "accuracy": round(e.value, 3),
             "reward": at("train/return", e.step), "response_length": at("train/length", e.step)} for e in accuracy]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "math_learning"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--config", default="math_grpo_tiny", help="the experiment (math_grpo_tiny_vllm: vLLM rollouts)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the training run")
    args = parser.parse_args()
    out = Path(args.out)

    import torch

    from envs.arithmetic import held_out_accuracy, write_split
    from policies.tiny_lm import warm_start

    torch.set_num_threads(1)  # a tiny model: more threads only contend
    write_split(out / "data")
    tic = time.monotonic()
    warm_start(out / "model", out / "data")
    warm = {"accuracy": held_out_accuracy(out / "model", out / "data")}
    print(f"warm start: held-out greedy accuracy {warm['accuracy']:.3f} after {time.monotonic() - tic:.1f} s", flush=True)

    command = [sys.executable, "-m", "embodied", "train", "--config-name", args.config,
               f"actor.model.model_path={out / 'model'}", f"data.train_data_paths=[{out / 'data' / 'train.jsonl'}]",
               f"data.val_data_paths=[{out / 'data' / 'test.jsonl'}]", f"runner.output_dir={out}",
               "runner.experiment_name=run", f"runner.max_epochs={args.steps}",
               f"runner.val_check_interval={args.val_every}", *args.overrides]
    print(" ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(done.returncode)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = curve(out / "run")
    print(f"{'time_s':>8} {'step':>5} {'accuracy':>9} {'reward':>7} {'length':>7}")
    for row in rows:
        train = "" if row["reward"] is None else f"{row['reward']:7.3f} {row['response_length']:7.2f}"
        print(f"{row['time_s']:8.1f} {row['step']:5d} {row['accuracy']:9.3f} {train}")
    gain = result["eval_success"] - result["eval_success_before"]
    print(f"held-out greedy accuracy {result['eval_success_before']:.3f} -> {result['eval_success']:.3f} "
          f"({gain:+.3f}) in {result['wall_s']:.0f} s of training", flush=True)
    print(json.dumps({"accuracy_warm_start": warm["accuracy"], "accuracy_start": result["eval_success_before"],
                      "accuracy_end": result["eval_success"], "gain": round(gain, 3),
                      "train_wall_s": result["wall_s"], "steps": args.steps, "curve": rows}))


if __name__ == "__main__":
    main()
