"""PPO on ManiSkill, synchronous vs one step off-policy, in one run: the same shipped config,
seed and number of steps, once with rollout and update one after the other
(``algorithm.staleness_threshold=0``) and once with the next rollout running while the actor
updates (``staleness_threshold=1``, ``loss_type=decoupled_actor_critic``).

    python benchmarks/async_ppo.py [--config-name maniskill_ppo_mlp] [--steps 50] [-o KEY=VALUE ...]

Prints, for each mode, the overall env steps/s (env steps over the sum of the runner's
``time/step``, the first step left out: it has nothing to overlap), the median of the phases
that bound a step (``time/rollout``, ``time/update``, ``time/actor_wait``, ``time/overlap``),
and the env steps until the first eval with success >= ``--target``; then the ratios async /
sync. The last line is JSON with ``throughput_async_vs_sync`` and
``env_steps_to_target_async_vs_sync`` (null when a mode never reached the target).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODES = {"sync": ["algorithm.staleness_threshold=0"],
         "async": ["algorithm.staleness_threshold=1", "algorithm.loss_type=decoupled_actor_critic",
                   "rollout.recompute_logprobs=false"]}
PHASES = ("time/rollout", "time/update", "time/actor_wait", "time/sync", "time/overlap")


def run(config: str, steps: int, out: Path, mode: str, overrides: list[str], target: float) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = [sys.executable, "-m", "embodied", "train", "--config-name", config, f"runner.max_epochs={steps}",
               f"runner.output_dir={out}", f"runner.experiment_name={mode}", "runner.save_interval=-1",
               *MODES[mode], *overrides]
    print("$ " + " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if done.returncode:
        sys.exit(f"the {mode} run failed (exit {done.returncode}): {' '.join(command)}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    events = EventAccumulator(str(out / mode / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def series(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in events.Scalars(tag)} if tag in tags else {}

    step_s, total = series("time/step"), series("train/total_env_steps")
    steady = [s for s in step_s if s > 1]
    env_steps = total[max(steady)] - total[min(steady) - 1]
    success = series("eval/success_once")
    reached = [s for s in sorted(success) if s > 0 and success[s] >= target]
    return {"env_steps_per_s": env_steps / sum(step_s[s] for s in steady),
            "phases": {tag: statistics.median(series(tag)[s] for s in steady) for tag in PHASES if tag in tags},
            "env_steps_to_target": total[reached[0]] if reached else None,
            "final_success": success[max(success)] if success else None, "wall_s": result.get("wall_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-name", default="maniskill_ppo_mlp")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.9, help="eval success the env-step count is taken at")
    parser.add_argument("--out", default=str(ROOT / "results" / "async_ppo"))
    parser.add_argument("-o", "--override", action="append", default=[], help="a config override for both runs")
    args = parser.parse_args()
    out = Path(args.out)
    results = {}
    for mode in MODES:
        r = results[mode] = run(args.config_name, args.steps, out, mode, args.override, args.target)
        print(f"{mode:>5}: {r['env_steps_per_s']:.0f} env steps/s; "
              + ", ".join(f"{k.split('/')[1]} {v:.3f} s" for k, v in r["phases"].items())
              + f"; env steps to success >= {args.target}: {r['env_steps_to_target']}; final success "
              f"{r['final_success']}; wall {r['wall_s']} s", flush=True)
    sync, ahead = results["sync"], results["async"]
    throughput = ahead["env_steps_per_s"] / sync["env_steps_per_s"]
    to_target = (ahead["env_steps_to_target"] / sync["env_steps_to_target"]
                 if ahead["env_steps_to_target"] and sync["env_steps_to_target"] else None)
    print(f"async / sync: throughput {throughput:.2f}x, env steps to target "
          + (f"{to_target:.2f}x" if to_target else "n/a"))
    print(json.dumps({"config": args.config_name, "steps": args.steps, "throughput_async_vs_sync": round(throughput, 3),
                      "env_steps_to_target_async_vs_sync": round(to_target, 3) if to_target else None,
                      **{f"{k}_{mode}": (round(v, 3) if isinstance(v, float) else v) for mode, r in results.items()
                         for k, v in r.items() if k != "phases"}}))


if __name__ == "__main__":
    main()
