"""Rollout throughput with ``rollout.pipeline_stage_num`` 2 against 1: rgb ManiSkill, CNN policy.

The rollout phase of a step through the real runtime: ``Runner.evaluate`` of an eval-only runner
(no actor), with its env worker on CPU slot 0 and its rollout worker on slot 1, trading
observations and actions through the shared-memory channel. With 1 stage the simulator steps all
envs and then the policy infers for all; with 2 stages the policy infers for one half while the
simulator steps the other. Same config otherwise (``maniskill_ppo_cnn`` plus the overrides
below): same envs, chunk steps, model and weights.

Two policies: the shipped CNN (64 px Nature-DQN convs: about 1 ms of inference against about
200 ms of CPU rendering per chunk step of 8 envs, so there is nothing to hide), and the same CNN
made about as costly as the rendering (stride-1 convs, 64/128/128 channels), the balanced case
pipelining is for. ``pipeline_speedup`` in the JSON line is the balanced one's; the shipped
CNN's figures carry the suffix ``_shipped_cnn``.

Each round launches fresh workers for 1 stage and then for 2, so that both share the machine's
load of the moment; the table holds medians over every timed call, and the ratio is the median of
the per-round ratios. To say what bounds the figure, the two halves are also timed alone in this
process: the same vector env stepping random actions (E per chunk step) and the same policy
inferring on its observations (P per chunk step); pipelining can at best turn E + P into
max(E, P).

    flock /tmp/bench.lock .venv/bin/python benchmarks/pipeline.py
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
import ray
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.env_throughput import cpu_parallelism  # noqa: E402
from embodied.cli import load  # noqa: E402
from embodied.runner import Runner  # noqa: E402
from envs import make_vector_env  # noqa: E402
from embodied.config import build_policy  # noqa: E402

# the CNN made about as costly as rendering (P close to E): stride-1 convs, twice the channels
WIDE = ["actor.model.conv_strides=[1,1,1]", "actor.model.conv_channels=[64,128,128]"]
PLACEMENT = ["cluster.component_placement.env=0", "cluster.component_placement.rollout=1",
             "cluster.component_placement.actor=1"]


def overrides(args: argparse.Namespace, stages: int, out: str) -> list[str]:
    return [
        *PLACEMENT, f"rollout.pipeline_stage_num={stages}", f"runner.output_dir={out}",
        f"env.eval.total_num_envs={args.envs}", f"env.eval.max_episode_steps={args.chunk_steps}",
        "env.eval.ignore_terminations=true", f"env.eval.num_processes={args.processes}",
        # the train split is built at launch but not stepped here: cheap state envs
        "env.train.total_num_envs=2", "env.train.init_params.obs_mode=state",
        *args.overrides,
    ]


def eval_only(cfg):
    """The runner's eval-only form (no actor); the untrained policy needs no checkpoint."""
    cfg = OmegaConf.to_container(cfg)
    cfg["runner"]["only_eval"] = True
    return OmegaConf.create(cfg)


def rollout_rates(args: argparse.Namespace, stages: int, extra: list[str], out: str) -> list[float]:
    """Env steps/s of ``args.repeats`` timed rollouts (after one warm-up) through the workers."""
    cfg, plan = load(args.config, overrides(args, stages, out) + extra)
    runner = Runner(eval_only(cfg), plan)
    try:
        rates = []
        for i in range(1 + args.repeats):
            metrics = runner.evaluate()
            if i:
                rates.append(metrics["eval/env_steps"] / metrics["time/eval"])
        return rates
    finally:
        runner.close()


def halves_alone(args: argparse.Namespace, workloads: dict[str, list[str]], out: str) -> dict[str, float]:
    """Milliseconds per chunk step of the vector env alone (random actions), and of each
    workload's policy alone (one thread, as the rollout worker runs it) on those observations."""
    cfg, _ = load(args.config, overrides(args, 1, out))
    env = make_vector_env(cfg.env.eval, args.envs)
    rng = np.random.default_rng(0)
    chunk = cfg.actor.model.num_action_chunks
    try:
        obs = env.reset()
        tic = time.perf_counter()
        for _ in range(args.chunk_steps):
            obs = env.chunk_step(rng.uniform(-1, 1, (args.envs, chunk, env.action_dim)))[0]
        times = {"env": (time.perf_counter() - tic) / args.chunk_steps * 1e3}
    finally:
        env.close()
    torch.set_num_threads(1)
    for name, extra in workloads.items():
        policy = build_policy(load(args.config, overrides(args, 1, out) + extra)[0].actor.model).eval()
        policy.act(obs, do_sample=False)
        tic = time.perf_counter()
        for _ in range(args.chunk_steps):
            policy.act(obs, do_sample=False)
        times[name] = (time.perf_counter() - tic) / args.chunk_steps * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="maniskill_ppo_cnn", help="experiment in config/")
    parser.add_argument("--envs", type=int, default=8, help="eval envs (both stage counts)")
    parser.add_argument("--chunk-steps", type=int, default=20, help="chunk steps per rollout")
    parser.add_argument("--processes", type=int, default=1,
                        help="simulator processes per stage (1: the env's work stays on its slot)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per launch")
    parser.add_argument("--rounds", type=int, default=3, help="launches of each stage count")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every workload")
    args = parser.parse_args()

    workloads = {"shipped CNN": [], "wide CNN": WIDE}
    parallelism = [cpu_parallelism()]
    ray.init(include_dashboard=False)  # one Ray for every launch (each runner only joins it)
    rates = {(w, s): [] for w in workloads for s in (1, 2)}
    with tempfile.TemporaryDirectory() as out:
        try:
            for _ in range(args.rounds):
                for (workload, stages), launches in rates.items():
                    launches.append(rollout_rates(args, stages, workloads[workload], out))
        finally:
            ray.shutdown()
        alone = halves_alone(args, workloads, out)
    parallelism.append(cpu_parallelism())

    cfg, _ = load(args.config, overrides(args, 1, "."))
    print(f"{cfg.env.eval.init_params.id} rgb {cfg.env.eval.init_params.camera_heights}px, "
          f"{args.envs} envs x {args.chunk_steps} chunk steps of {cfg.actor.model.num_action_chunks} "
          f"action(s), {args.processes} simulator process(es) per stage, env worker on CPU slot 0, "
          f"rollout worker on 1; {args.rounds} rounds x {args.repeats} rollouts per stage count")
    print(f"CPU parallelism available (2 busy processes vs 1; before, after): {parallelism}")
    print(f"{'workload':>12} {'stages':>6} {'env steps/s':>12} {'ms/chunk step':>14} {'2 vs 1':>7} "
          f"{'E (ms)':>7} {'P (ms)':>7} {'bound':>6}")
    result = {}
    for workload in workloads:
        one, two = rates[(workload, 1)], rates[(workload, 2)]
        per_round = [statistics.median(b) / statistics.median(a) for a, b in zip(one, two)]
        speedup = statistics.median(per_round)
        e, p = alone["env"], alone[workload]
        bound = (e + p) / max(e, p)
        for stages, launches in ((1, one), (2, two)):
            rate = statistics.median(r for launch in launches for r in launch)
            tail = (f"{speedup:>6.2f}x {e:>7.1f} {p:>7.1f} {bound:>5.2f}x" if stages == 2 else "")
            print(f"{workload:>12} {stages:>6} {rate:>12.1f} {args.envs / rate * 1e3:>14.1f} {tail}")
        key = "" if workload == "wide CNN" else "_shipped_cnn"
        result |= {f"pipeline_speedup{key}": round(speedup, 3), f"ideal_bound{key}": round(bound, 3),
                   f"policy_ms{key}": round(p, 1), f"per_round{key}": [round(r, 3) for r in per_round]}
    result |= {"env_ms": round(alone["env"], 1), "cpu_parallelism": parallelism}
    print("E: the vector env alone, P: the policy alone, per chunk step of all envs; "
          "bound: (E + P) / max(E, P)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
