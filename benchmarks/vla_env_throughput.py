"""Env steps per second of ManiSkill with cameras at the sizes a tiny VLA could use, on this CPU.

Rendering (lavapipe, in software) is most of an rgb step here, so the ManiSkill adapter renders
only what the policy reads: the cameras it consumes (``main_camera``, ``wrist_camera``) and, on
the CPU simulation, only the observation that is read, once per ``chunk_step`` chunk. This
measures what that gives, per task, camera size and cameras (main, or main + wrist with
``robot_uids: panda_wristcam``), ``pd_ee_delta_pose``, random actions, auto-reset:

- ours, ``--envs`` envs (``make_vector_env``: one process per core), chunks of 1 (an
  observation after every step: what recording and one-action policies read) and of
  ``--chunk`` actions (a VLA's action chunk: one observation per chunk);
- ours with ``render_mesh_triangles: --mesh-triangles`` (envs/meshes.py: every visual mesh
  above that many triangles simplified when the scene is built; lavapipe's cost per frame is its
  triangles, and the Panda has 135k), chunks of 1 and of ``--chunk``;
- plain ManiSkill, one ``gym.make`` env in this process with the same robot (both of its
  cameras) and size, observing after every step: what the adapter did before per env.

Every repeat measures the configuration's five rates in turn, so that they share the machine's
load of that moment; the table holds medians over repeats, and the ratios (chunks of
``--chunk`` over chunks of 1, ours with chunks of 1 over plain, simplified meshes over the
assets' at chunks of 1 and of ``--chunk``) are medians of per-repeat ratios,
which hold up better than the rates on a machine shared with other jobs. The CPU parallelism
figures say how much of two cores the machine gave (2.0: two idle cores) before and after.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/vla_env_throughput.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.env_throughput import cpu_parallelism  # noqa: E402
from embodied.config import load_env_config  # noqa: E402
from envs import make_vector_env  # noqa: E402
from envs.maniskill import check_params  # noqa: E402
from envs.maniskill_scene import make_kwargs  # noqa: E402

CONFIGS = {"PushCube-v1": "maniskill_push_cube", "PickCube-v1": "maniskill_pick_cube"}


def env_config(task: str, size: int, wrist: bool, mesh_triangles: int | None = None):
    return load_env_config(CONFIGS[task], [
        "init_params.obs_mode=rgb", "init_params.control_mode=pd_ee_delta_pose",
        "init_params.robot_uids=panda_wristcam", f"init_params.wrist_camera={'hand_camera' if wrist else 'null'}",
        f"init_params.camera_heights={size}", f"init_params.camera_widths={size}", "auto_reset=true",
        f"init_params.render_mesh_triangles={mesh_triangles or 'null'}"])


def ours_rate(env, chunk_steps: int, chunk: int, rng: np.random.Generator) -> float:
    """Env steps/s of ``chunk_step`` (every env, every step counted)."""
    start = time.perf_counter()
    for _ in range(chunk_steps):
        env.chunk_step(rng.uniform(-1, 1, (env.num_envs, chunk, env.action_dim)))
    return env.num_envs * chunk_steps * chunk / (time.perf_counter() - start)


def plain_rate(env, steps: int, rng: np.random.Generator) -> float:
    """Env steps/s of a raw ManiSkill env computing its observation after every step."""
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(rng.uniform(-1, 1, env.action_space.shape))
        if terminated.item() or truncated.item():
            env.reset()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 128])
    parser.add_argument("--envs", type=int, default=2, help="envs of our vector env")
    parser.add_argument("--chunk", type=int, default=8, help="actions per chunk of a VLA")
    parser.add_argument("--steps", type=int, default=24, help="env steps per env per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mesh-triangles", type=int, default=2000, help="render_mesh_triangles of the simplified rows")
    args = parser.parse_args()

    import gymnasium as gym

    rng = np.random.default_rng(0)
    parallelism = [cpu_parallelism()]
    rows = []
    for task in args.tasks:
        for size in args.sizes:
            for wrist in (False, True):
                cfg = env_config(task, size, wrist)
                rates = {"ours_chunk1": [], f"ours_chunk{args.chunk}": [], "plain": [],
                         "simple_chunk1": [], f"simple_chunk{args.chunk}": []}
                with make_vector_env(cfg, num_envs=args.envs) as env, \
                        make_vector_env(env_config(task, size, wrist, args.mesh_triangles), num_envs=args.envs) as simple:
                    plain = gym.make(task, **make_kwargs(check_params(cfg.init_params), 1, cfg.max_episode_steps))
                    try:
                        env.reset(), simple.reset()
                        plain.reset(seed=0)
                        ours_rate(env, 1, args.chunk, rng), ours_rate(simple, 1, args.chunk, rng)  # warm up
                        plain_rate(plain, 2, rng)
                        for _ in range(args.repeats):
                            for name, vec in (("ours", env), ("simple", simple)):
                                rates[f"{name}_chunk1"].append(ours_rate(vec, args.steps, 1, rng))
                                rates[f"{name}_chunk{args.chunk}"].append(
                                    ours_rate(vec, max(1, args.steps // args.chunk), args.chunk, rng))
                            rates["plain"].append(plain_rate(plain, args.steps, rng))
                    finally:
                        plain.close()
                row = {"task": task, "size": size, "cameras": "main+wrist" if wrist else "main"}
                row |= {k: round(statistics.median(v), 1) for k, v in rates.items()}
                row["chunk_gain"] = round(statistics.median(
                    c / o for c, o in zip(rates[f"ours_chunk{args.chunk}"], rates["ours_chunk1"])), 2)
                row["ours_vs_plain"] = round(statistics.median(
                    o / b for o, b in zip(rates["ours_chunk1"], rates["plain"])), 2)
                for c in (1, args.chunk):
                    row[f"mesh_gain_chunk{c}"] = round(statistics.median(
                        s / o for s, o in zip(rates[f"simple_chunk{c}"], rates[f"ours_chunk{c}"])), 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    parallelism.append(cpu_parallelism())

    chunked = f"ours_chunk{args.chunk}"
    print(f"\nenv steps/s, medians of {args.repeats} repeats; ours: {args.envs} envs in processes, plain: "
          f"1 env in this process rendering both cameras of panda_wristcam after every step; "
          f"CPU parallelism (before, after): {parallelism}; simplified: render_mesh_triangles={args.mesh_triangles}")
    print(f"{'task':>12} {'px':>4} {'cameras':>10} {'ours C=1':>9} {f'ours C={args.chunk}':>9} {'plain':>7} "
          f"{f'C={args.chunk}/C=1':>9} {'C=1/plain':>9} {'simpl C=1':>9} {f'simpl C={args.chunk}':>9} "
          f"{'mesh C=1':>8} {f'mesh C={args.chunk}':>8}")
    for r in rows:
        print(f"{r['task']:>12} {r['size']:>4} {r['cameras']:>10} {r['ours_chunk1']:>9.1f} "
              f"{r[chunked]:>9.1f} {r['plain']:>7.1f} {r['chunk_gain']:>9.2f} {r['ours_vs_plain']:>9.2f} "
              f"{r['simple_chunk1']:>9.1f} {r[f'simple_chunk{args.chunk}']:>9.1f} "
              f"{r['mesh_gain_chunk1']:>8.2f} {r[f'mesh_gain_chunk{args.chunk}']:>8.2f}")
    print(json.dumps({"envs": args.envs, "chunk": args.chunk, "cpu_parallelism": parallelism,
                      "mesh_triangles": args.mesh_triangles, "rows": rows,
                      "mesh_gain_chunk1": {f"{r['task']}/{r['size']}/{r['cameras']}": r["mesh_gain_chunk1"]
                                           for r in rows}}))


if __name__ == "__main__":
    main()
