"""Simulator processes starting and ending: a block of ManiSkill scenes built and, at the end,
closed one by one (the baseline, what ``envs/subproc.py``'s children did) against built after
``gc.freeze()`` and left to end with their process (ours).

ManiSkill collects garbage at every scene build and close (``BaseEnv._clear``: ``gc.collect()``),
and a simulator process holds everything torch, SAPIEN and ManiSkill imported: each collection
walks all of it, about 0.2 s here. Frozen right after the imports, those objects are skipped.

The shipped ``maniskill_ppo_mlp`` training envs (PushCube), ``--processes`` processes of
``--envs`` scenes each, as one env rank's simulators: each side runs in processes of this script
that import ManiSkill, then build their scenes (timed) and, on request, end (timed until every
process is gone). Rounds alternate; the ratios are of the medians. The last line also times the
real thing, ``make_vector_env`` then ``close`` of those envs.

    flock /tmp/bench.lock .venv/bin/python benchmarks/simulators.py --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _simulator(factory, count: int, ours: bool, conn) -> None:
    """One simulator process: imports, ``count`` scenes (timed), then an end on request."""
    importlib.import_module("envs.maniskill_scene")  # the forkserver's preload
    if ours:
        gc.freeze()
    tic = time.monotonic()
    scenes = [factory() for _ in range(count)]
    conn.send(time.monotonic() - tic)
    conn.recv()
    if not ours:
        for scene in scenes:
            scene.close()


def one_side(factory, processes: int, envs: int, ours: bool) -> tuple[float, float]:
    """(slowest process's build, end request until every process is gone)."""
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(processes)]
    procs = [context.Process(target=_simulator, args=(factory, envs, ours, child)) for _, child in pipes]
    for proc in procs:
        proc.start()
    build = max(parent.recv() for parent, _ in pipes)
    tic = time.monotonic()
    for parent, _ in pipes:
        parent.send("end")
    for proc in procs:
        proc.join()
    return build, time.monotonic() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--envs", type=int, default=16, help="scenes per process")
    args = parser.parse_args()
    from omegaconf import OmegaConf

    from embodied.config import compose
    from envs import make_vector_env
    from envs.maniskill import _scene, check_params, read_options

    total = args.processes * args.envs
    env_cfg = compose("maniskill_ppo_mlp", [f"env.train.num_processes={args.processes}"]).env.train
    p = check_params(OmegaConf.to_container(env_cfg.init_params, resolve=True))
    factory = functools.partial(_scene, p, read_options(env_cfg, total, 0)["max_episode_steps"], False)
    runs: dict[str, list[tuple[float, float]]] = {"baseline": [], "ours": []}
    for round_ in range(args.rounds):
        for name in ("baseline", "ours") if round_ % 2 == 0 else ("ours", "baseline"):
            runs[name].append(one_side(factory, args.processes, args.envs, name == "ours"))
            print(f"round {round_} {name}: build {runs[name][-1][0]:.2f} s, end {runs[name][-1][1]:.2f} s", flush=True)
    median = {name: [statistics.median(r[i] for r in runs[name]) for i in (0, 1)] for name in runs}
    tic = time.monotonic()
    env = make_vector_env(env_cfg, total)
    built = time.monotonic() - tic
    tic = time.monotonic()
    env.close()
    print(json.dumps({"scenes": total, "processes": args.processes,
                      "build_s": {"baseline": round(median["baseline"][0], 2), "ours": round(median["ours"][0], 2)},
                      "end_s": {"baseline": round(median["baseline"][1], 2), "ours": round(median["ours"][1], 2)},
                      "build_ratio": round(median["baseline"][0] / median["ours"][0], 2),
                      "end_ratio": round(median["baseline"][1] / median["ours"][1], 1),
                      "make_vector_env_s": round(built, 2), "close_s": round(time.monotonic() - tic, 2)}))


if __name__ == "__main__":
    main()
