"""Env steps per second on LIBERO: our vector env against LIBERO's own ways of running it.

All on a real suite task (``--suite``, ``--task``: LIBERO-Spatial's first by default, from the
installed asset packages), from its init state 0, with the same camera size and random 7-d
actions:

- overhead at 1 env: ours (``make_vector_env``, one env in this process, ``chunk_step`` chunks)
  against a plain loop over LIBERO's ``OffScreenRenderEnv`` with the same two cameras;
- N envs: ours (subprocess blocks writing observations into shared memory) against LIBERO's own
  ``SubprocVectorEnv`` (tianshou's, which pickles every observation dict through a pipe) with
  the same number of envs and cameras, stepped one action at a time as LIBERO's scripts do.
  LIBERO runs a process per env; ours runs one per core by default (``num_processes: null``),
  which on a machine shared with other jobs gets fewer time slices than more processes would,
  so ours is measured both ways: one process per env (like for like) and the default;
- what is rendered: LIBERO's env renders every camera it was built with at every step; ours
  renders only the cameras the policy consumes, and only in the last step of a chunk (the
  observation the policy reads; tests/test_libero_suites.py checks the images are LIBERO's own),
  so a one-image policy (``wrist_camera: null``) also skips the wrist render.

Each pair of configurations is built, measured and closed in turn (LIBERO processes take
about 1 GB each); every repeat measures the pair in the order A B B A (each figure the mean of
its two halves), so that both sides of a ratio share the machine's load of that moment; the table holds medians over repeats and ratios are medians of per-repeat ratios.
Resets are not timed (every run steps from one init state).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/libero_throughput.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embodied.config import load_env_config  # noqa: E402
from envs import make_vector_env  # noqa: E402
from envs.libero import check_config  # noqa: E402

CAMERAS = ["agentview", "robot0_eye_in_hand"]


def libero_env(bddl: str, init_state: np.ndarray, assets: str, size: int, cameras: list[str]):
    """LIBERO's own env as its scripts build it (hard resets, its default), at ``init_state``."""
    import libero.libero

    libero.libero._assets_path_cache = assets
    from libero.libero.envs import OffScreenRenderEnv

    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_names=cameras,
                             camera_heights=size, camera_widths=size)
    env.seed(0)
    env.reset()
    env.set_init_state(init_state)
    return env


def raw_rate(env, steps: int, rng: np.random.Generator) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        env.step(rng.uniform(-1, 1, 7))
    return steps / (time.perf_counter() - start)


def libero_subproc_rate(venv, n: int, steps: int, rng: np.random.Generator) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        venv.step(rng.uniform(-1, 1, (n, 7)))
    return n * steps / (time.perf_counter() - start)


def ours_rate(env, steps: int, chunk: int, rng: np.random.Generator) -> float:
    start = time.perf_counter()
    for _ in range(steps // chunk):
        env.chunk_step(rng.uniform(-1, 1, (env.num_envs, chunk, 7)).astype(np.float32))
    return env.num_envs * (steps // chunk) * chunk / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--size", type=int, default=128, help="camera height and width")
    parser.add_argument("--chunk", type=int, default=8, help="actions per chunk_step")
    parser.add_argument("--steps", type=int, default=32,
                        help="env steps per env per configuration and repeat (two halves)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--suite", default="libero_spatial")
    parser.add_argument("--task", type=int, default=0, help="index of the task in the suite")
    args = parser.parse_args()
    if 1 not in args.envs:
        parser.error("--envs must include 1 (the reference for the overhead)")

    def ours_cfg(wrist: bool, processes: int | None = None):
        return load_env_config(args.suite, [
            f"num_processes={processes or 'null'}", f"init_params.task_ids=[{args.task}]",
            "init_params.init_state_range=[0,1]", "init_params.num_settle_steps=0",
            f"init_params.camera_heights={args.size}", f"init_params.camera_widths={args.size}",
            f"init_params.wrist_camera={CAMERAS[1] if wrist else 'null'}",
            f"max_episode_steps={10**6}"])

    setup = check_config(ours_cfg(True))  # the task, its init states and the assets (one clear error if missing)
    task = setup.tasks[0]
    libero_env_fn = functools.partial(libero_env, task.bddl_file, task.init_states[0], str(setup.assets))

    rng = np.random.default_rng(0)
    multi = [n for n in args.envs if n > 1]
    half = args.steps // 2
    from libero.libero.envs import SubprocVectorEnv as LiberoSubproc

    # (label, factory, rate) pairs; each pair is built, measured and closed before the next, so
    # that at most one pair's processes (about 1 GB each) are alive at a time
    def libero_subproc(n):
        return (f"libero_subproc {n}", lambda: LiberoSubproc(
            [functools.partial(libero_env_fn, args.size, CAMERAS)] * n),
            lambda env: libero_subproc_rate(env, n, half, rng))

    def ours(label, n, wrist=True, processes=None):
        return (label, lambda: make_vector_env(ours_cfg(wrist, processes), num_envs=n),
                lambda env: ours_rate(env, half, args.chunk, rng))

    raw = ("raw 1", lambda: libero_env_fn(args.size, CAMERAS), lambda env: raw_rate(env, half, rng))
    # LIBERO's SubprocVectorEnv forks this process: its pairs come first, before this process
    # renders anything (a child forked after EGL was initialized here hangs)
    pairs = []
    for n in multi:
        pairs.append((libero_subproc(n), ours(f"ours {n}", n, processes=n)))
        if n > (os.cpu_count() or 1):  # ours with its default of fewer processes than envs
            pairs.append(((f"libero_subproc {n} (vs default)", *libero_subproc(n)[1:]),
                          ours(f"ours {n} default processes", n)))
    pairs += [(raw, ours("ours 1", 1)),
              (ours("ours 1 main camera only", 1, wrist=False), ours("ours 1 (vs main only)", 1))]
    rates: dict[str, list[float]] = {}
    for (label_a, make_a, rate_a), (label_b, make_b, rate_b) in pairs:
        a = make_a()
        try:
            b = make_b()
            try:
                if label_b.startswith("ours"):
                    b.reset()
                if label_a.startswith("ours"):
                    a.reset()
                for r in range(args.repeats + 1):  # round 0 warms up (JIT, caches), dropped
                    a1, b1, b2, a2 = rate_a(a), rate_b(b), rate_b(b), rate_a(a)
                    if r:
                        rates.setdefault(label_a, []).append((a1 + a2) / 2)
                        rates.setdefault(label_b, []).append((b1 + b2) / 2)
            finally:
                b.close()
        finally:
            a.close()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    print(f"LIBERO {args.suite} task {args.task} ({task.name}), 2 cameras {args.size}x{args.size}, chunks of {args.chunk}, "
          f"{args.steps} steps/env x {args.repeats} repeats (medians; env steps/s)")
    default = [n for n in multi if n > (os.cpu_count() or 1)]
    print(f"{'envs':>5} {'LIBERO plain loop':>18} {'LIBERO SubprocVectorEnv':>24} {'ours':>7} {'ours/LIBERO':>12}")
    print(f"{1:>5} {statistics.median(rates['raw 1']):>18.1f} {'':>24} "
          f"{statistics.median(rates['ours 1']):>7.1f} {ratio('ours 1', 'raw 1'):>12.3f}")
    for n in multi:
        print(f"{n:>5} {'':>18} {statistics.median(rates[f'libero_subproc {n}']):>24.1f} "
              f"{statistics.median(rates[f'ours {n}']):>7.1f} "
              f"{ratio(f'ours {n}', f'libero_subproc {n}'):>12.3f}")
    for n in default:
        print(f"{n:>5} {'':>18} {statistics.median(rates[f'libero_subproc {n} (vs default)']):>24.1f} "
              f"{statistics.median(rates[f'ours {n} default processes']):>7.1f} "
              f"{ratio(f'ours {n} default processes', f'libero_subproc {n} (vs default)'):>12.3f}"
              f"  (ours in {os.cpu_count()} processes, one per core)")
    print(f"1 env, main camera only (a one-image policy): "
          f"{statistics.median(rates['ours 1 main camera only']):.1f} steps/s, "
          f"{ratio('ours 1 main camera only', 'ours 1 (vs main only)'):.2f}x both cameras")
    print(json.dumps({
        "suite": args.suite, "task": args.task, "size": args.size, "chunk": args.chunk,
        "raw_1env": round(statistics.median(rates["raw 1"]), 2),
        "ours_1env": round(statistics.median(rates["ours 1"]), 2),
        "vs_libero_plain_loop_1env": round(ratio("ours 1", "raw 1"), 3),
        "vs_libero_subproc": {str(n): round(ratio(f"ours {n}", f"libero_subproc {n}"), 3)
                              for n in multi},
        "target_3x_met": all(ratio(f"ours {n}", f"libero_subproc {n}") >= 3 for n in multi),
        "vs_libero_subproc_default_processes": {
            str(n): round(ratio(f"ours {n} default processes", f"libero_subproc {n} (vs default)"), 3)
            for n in default},
        "main_camera_only_speedup": round(ratio("ours 1 main camera only", "ours 1 (vs main only)"), 3),
    }))


if __name__ == "__main__":
    main()
