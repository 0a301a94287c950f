"""Env steps per second: our ManiSkill vector env against a plain loop over raw ManiSkill envs.

Baseline: ``gym.make(task, obs_mode="state")`` envs in this process, stepped one after another
with random actions and reset when their episode ends (the plain way to run N envs on
ManiSkill's CPU simulation, which holds one scene per env). Ours: ``make_vector_env`` with the
same task, observations and number of envs (auto-reset; one subprocess per env, a lone env in
this process), stepped with ``chunk_step`` chunks of random actions; the row "1 (subprocess)"
runs a lone env in a subprocess, to show what that form would cost.

Every repeat measures every configuration, baseline then ours, so that all figures of a repeat
share the machine's load of that moment; the table holds medians over repeats, the ratios are
medians of the per-repeat ratios. Overhead is measured at 1 env; scaling is ours at N envs over
the baseline's 1 env. The CPU parallelism line says how much of two cores the machine gave.

    flock /tmp/bench.lock .venv/bin/python benchmarks/env_throughput.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.maniskill import check_params, select_vulkan_driver  # noqa: E402
from envs.maniskill_scene import ManiSkillEnv  # noqa: E402
from envs.subproc import SubprocVectorEnv  # noqa: E402
from embodied.config import load_env_config  # noqa: E402
from envs import make_vector_env  # noqa: E402
from envs.vector_env import VectorEnv, read_options  # noqa: E402


def raw_rate(envs: list, steps: int, rng: np.random.Generator) -> float:
    """Env steps/s of a plain loop over raw ManiSkill envs."""
    start = time.perf_counter()
    for _ in range(steps):
        for env in envs:
            _, _, terminated, truncated, _ = env.step(rng.uniform(-1, 1, env.action_space.shape))
            if terminated.item() or truncated.item():
                env.reset()
    return len(envs) * steps / (time.perf_counter() - start)


def ours_rate(env, steps: int, chunk: int, rng: np.random.Generator) -> float:
    """Env steps/s of ``chunk_step`` over the same number of env steps."""
    start = time.perf_counter()
    for _ in range(steps // chunk):
        env.chunk_step(rng.uniform(-1, 1, (env.num_envs, chunk, env.action_dim)))
    return env.num_envs * (steps // chunk) * chunk / (time.perf_counter() - start)


def _spin(n: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return time.perf_counter() - start


def cpu_parallelism(n: int = 5_000_000) -> float:
    """How many cores' worth of pure-Python work two processes get done right now, relative to
    one (2.0 on two idle cores): the ceiling for any multi-env figure on a shared machine."""
    one = _spin(n)
    with mp.get_context("forkserver").Pool(2) as pool:
        two = pool.map(_spin, [n, n])
    return round(2 * one / max(two), 2)


def _lone_env(cfg):
    import functools

    return functools.partial(ManiSkillEnv, check_params(cfg.init_params), cfg.max_episode_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="maniskill_push_cube", help="config/env group file")
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunk", type=int, default=5, help="actions per chunk_step")
    parser.add_argument("--steps", type=int, default=400, help="env steps per env per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if 1 not in args.envs:
        parser.error("--envs must include 1 (the reference for overhead and scaling)")

    import gymnasium as gym

    select_vulkan_driver()
    cfg = load_env_config(args.config, ["init_params.obs_mode=state", "auto_reset=true"])
    p = cfg.init_params
    rng = np.random.default_rng(0)
    # configurations (label, envs, chunk): the chosen chunk for every size, a lone env in a
    # subprocess, and chunk 1 at 1 env
    configs = [(str(n), n, args.chunk) for n in args.envs] + [("1 (subprocess)", 1, args.chunk)]
    if args.chunk != 1:
        configs.append(("1", 1, 1))
    raw = {n: [gym.make(p.id, obs_mode="state", control_mode=p.control_mode,
                        reward_mode=p.reward_mode, render_backend="cpu",
                        max_episode_steps=cfg.max_episode_steps) for _ in range(n)]
           for n in args.envs}
    ours = {str(n): make_vector_env(cfg, num_envs=n) for n in args.envs}
    lone = SubprocVectorEnv([_lone_env(cfg)], preload=["envs.maniskill_scene"])
    ours["1 (subprocess)"] = VectorEnv(lone, **read_options(cfg, 1))
    parallelism = [cpu_parallelism()]
    rates = {c: {"raw": [], "ours": []} for c in configs}
    try:
        for n in args.envs:
            for i, env in enumerate(raw[n]):
                env.reset(seed=i)
        for label, n, _ in configs:
            ours[label].reset()
            raw_rate(raw[n], 50, rng), ours_rate(ours[label], 50, args.chunk, rng)  # warm up
        for _ in range(args.repeats):
            for label, n, chunk in configs:
                rates[(label, n, chunk)]["raw"].append(raw_rate(raw[n], args.steps, rng))
                rates[(label, n, chunk)]["ours"].append(ours_rate(ours[label], args.steps, chunk, rng))
    finally:
        for env in ours.values():
            env.close()
        for envs in raw.values():
            for env in envs:
                env.close()
    parallelism.append(cpu_parallelism())

    base = rates[("1", 1, args.chunk)]["raw"]  # the plain single-env loop, per repeat
    rows = []
    for (label, n, chunk), r in rates.items():
        rows.append(dict(
            label=label, envs=n, chunk=chunk,
            raw=statistics.median(r["raw"]), ours=statistics.median(r["ours"]),
            vs_raw=statistics.median(o / b for o, b in zip(r["ours"], r["raw"])),
            vs_raw1=statistics.median(o / b for o, b in zip(r["ours"], base))))
    print(f"{p.id}, state obs, {p.control_mode}, {args.steps} steps/env x {args.repeats} repeats "
          "(medians; env steps/s)")
    print(f"CPU parallelism available (2 busy processes vs 1; before, after): {parallelism}")
    print(f"{'envs':>14} {'chunk':>5} {'raw loop':>9} {'ours':>8} {'ours/raw':>8} "
          f"{'ours/raw(1 env)':>15}")
    for r in rows:
        print(f"{r['label']:>14} {r['chunk']:>5} {r['raw']:>9.0f} {r['ours']:>8.0f} "
              f"{r['vs_raw']:>8.3f} {r['vs_raw1']:>15.3f}")
    one = rows[[c[0] for c in configs].index("1")]
    lone_sub = next(r for r in rows if r["label"] == "1 (subprocess)")
    multi = [r for r in rows if r["envs"] > 1] or [one]
    best = max(multi, key=lambda r: r["vs_raw1"])
    result = {
        "task": str(p.id), "chunk": args.chunk,
        "raw_1env": round(one["raw"], 1), "ours_1env": round(one["ours"], 1),
        "overhead_1env": round(1 - one["vs_raw"], 4),
        "overhead_1env_subprocess": round(1 - lone_sub["vs_raw"], 4),
        "best_envs": best["envs"], "ours_best": round(best["ours"], 1),
        "best_scaling": round(best["vs_raw1"], 3),
        "cpu_parallelism": parallelism,
    }
    if args.chunk != 1:
        result["overhead_1env_chunk1"] = round(1 - rows[-1]["vs_raw"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
