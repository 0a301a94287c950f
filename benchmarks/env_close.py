"""Closing a run's simulator processes: each process closing its ManiSkill envs before it exits
(the baseline, what ``envs/subproc.py``'s children did) against exiting at once (ours: a child's
envs go with its process).

Both sides build the shipped ``maniskill_ppo_mlp`` training envs (PushCube, 32 envs in 2
processes of 16, as one env rank of the suite's runs holds) and time from the close request to
both processes gone. The baseline runs in processes of this script that build the same 16
single-scene envs (``envs.maniskill._scene``) and close them before exiting; ours is
``make_vector_env(...).close()``. Rounds alternate; the ratio is of the medians.

    flock /tmp/bench.lock .venv/bin/python benchmarks/env_close.py --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENVS, PROCESSES = 32, 2


def _closing_child(factory, count: int, conn) -> None:
    """The baseline's process: ``count`` envs, closed on request, then gone."""
    envs = [factory() for _ in range(count)]
    conn.send("built")
    conn.recv()
    for env in envs:
        env.close()


def baseline(env_cfg) -> float:
    from envs.maniskill import _scene, check_params, read_options

    from omegaconf import OmegaConf

    p = check_params(OmegaConf.to_container(env_cfg.init_params, resolve=True))
    factory = functools.partial(_scene, p, read_options(env_cfg, ENVS, 0)["max_episode_steps"], False)
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(PROCESSES)]
    procs = [context.Process(target=_closing_child, args=(factory, ENVS // PROCESSES, child)) for _, child in pipes]
    for proc in procs:
        proc.start()
    for parent, _ in pipes:
        parent.recv()
    tic = time.monotonic()
    for parent, _ in pipes:
        parent.send("close")
    for proc in procs:
        proc.join()
    return time.monotonic() - tic


def ours(env_cfg) -> float:
    from envs import make_vector_env

    env = make_vector_env(env_cfg, ENVS)
    tic = time.monotonic()
    env.close()
    return time.monotonic() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from embodied.config import compose

    env_cfg = compose("maniskill_ppo_mlp", [f"env.train.num_processes={PROCESSES}"]).env.train
    times: dict[str, list[float]] = {"baseline": [], "ours": []}
    for round_ in range(args.rounds):
        for name in ("baseline", "ours") if round_ % 2 == 0 else ("ours", "baseline"):
            times[name].append(globals()[name](env_cfg))
            print(f"round {round_} {name}: {times[name][-1]:.2f} s", flush=True)
    base, mine = statistics.median(times["baseline"]), statistics.median(times["ours"])
    print(json.dumps({"envs": ENVS, "processes": PROCESSES, "baseline_close_s": round(base, 3),
                      "ours_close_s": round(mine, 3), "ratio": round(base / mine, 1)}))


if __name__ == "__main__":
    main()
