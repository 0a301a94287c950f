"""CPU time of an env worker's start with cameras: SAPIEN computing its BRDF table in every
scene process (the baseline) against the table stored once per machine (envs/sapien_lut.py).

Each round starts a fresh process that makes the rgb PushCube vector env of the VLA configs (2
envs in 2 scene processes, 128 px) and steps one 10-step episode: what an env worker does at
the start of a run or an evaluation. The baseline's store is a path that cannot be made
(``XDG_CACHE_HOME=/dev/null/cache``); ours is this machine's store, made first if missing. CPU
seconds are the whole machine's busy time while the process runs (its scene processes are not
its children to wait for), so run it on an idle machine; rounds alternate; medians and ratios.

    .venv/bin/python benchmarks/sapien_lut.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = """
import numpy as np
from embodied.config import load_env_config
from envs import make_vector_env

cfg = load_env_config("maniskill_push_cube", ["init_params.obs_mode=rgb", "init_params.camera_heights=128",
                                              "init_params.camera_widths=128", "num_processes=2"])
with make_vector_env(cfg, num_envs=2) as env:
    env.reset()
    for _ in range(10):
        env.chunk_step(np.zeros((2, 1, 8), np.float32))
"""


def busy_seconds() -> float:
    """The machine's CPU time so far, idle and I/O wait left out (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(cache: str | None) -> tuple[float, float]:
    env = dict(os.environ) | ({"XDG_CACHE_HOME": cache} if cache else {})
    busy, tic = busy_seconds(), time.monotonic()
    subprocess.run([sys.executable, "-c", START], cwd=ROOT, env=env, check=True, capture_output=True)
    return busy_seconds() - busy, time.monotonic() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpu_seconds(None)  # makes this machine's store if missing, and warms the file cache
    runs: dict[str, list[tuple[float, float]]] = {"computed": [], "stored": []}
    for r in range(args.rounds):
        order = [("computed", "/dev/null/cache"), ("stored", None)]
        for name, cache in order if r % 2 == 0 else order[::-1]:
            runs[name].append(cpu_seconds(cache))
        print(f"round {r + 1}: " + ", ".join(f"{name} {values[-1][0]:.1f} CPU-s ({values[-1][1]:.1f} s)"
                                            for name, values in runs.items()), flush=True)
    cpu = {name: statistics.median(c for c, _ in values) for name, values in runs.items()}
    wall = {name: statistics.median(w for _, w in values) for name, values in runs.items()}
    print(json.dumps({"computed_cpu_s": round(cpu["computed"], 1), "stored_cpu_s": round(cpu["stored"], 1),
                      "computed_wall_s": round(wall["computed"], 1), "stored_wall_s": round(wall["stored"], 1),
                      "cpu_ratio": round(cpu["computed"] / cpu["stored"], 2),
                      "wall_ratio": round(wall["computed"] / wall["stored"], 2)}))


if __name__ == "__main__":
    main()
