"""Soak: a small training run for a few hundred steps, watching for leaks.

Runs ``embodied-train`` (PPO on PushCube, 4 envs, 10-step episodes, an eval every 25 steps, a
checkpoint every 50 keeping 2) and samples every ``--every`` seconds the resident memory (RSS) of
each worker kind (a rank's process plus its children: the env workers' simulator processes) and
the bytes of the run's shared-memory segments in /dev/shm (channel slots and queues, env
observation blocks: every ``embch.<host>.<pid>.*`` segment of the driver or a worker). Prints each
kind's RSS growth from the end of the warm-up (``--warmup`` of the steps) to the end, the /dev/shm
series, and one line of JSON. Targets: growth < 5 % per kind, /dev/shm flat after warm-up.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/soak.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import psutil

from core.shm import creator_prefix

GROUPS = ("EnvGroup", "RolloutGroup", "ActorGroup")
PIDS = re.compile(r"rank \d+ pid (\d+) on node")
STEP = re.compile(r"(\d+)/(\d+) \[")


def rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (0 once it is gone)."""
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def shm_bytes(pids: list[int]) -> int:
    prefixes = tuple(creator_prefix(pid) for pid in pids)
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefixes):
            try:
                total += os.stat(os.path.join("/dev/shm", name)).st_size
            except FileNotFoundError:
                pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of steps left out")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="soak-")
    command = [sys.executable, "-m", "embodied", "train", f"runner.output_dir={out}",
               f"runner.max_epochs={args.steps}", "runner.val_check_interval=25",
               "runner.save_interval=50", "runner.max_ckpts_to_keep=2",
               "env.train.total_num_envs=4", "env.train.max_episode_steps=10",
               "env.eval.total_num_envs=4", "env.eval.max_episode_steps=10",
               "actor.global_batch_size=20", "actor.micro_batch_size=10"]
    log = open(os.path.join(out, "stdout"), "w+")
    err = open(os.path.join(out, "stderr"), "w+")
    proc = subprocess.Popen(command, stdout=log, stderr=err)
    pids: dict[str, list[int]] = {}
    samples: list[dict] = []  # {"t", "step", "rss": {group: bytes}, "shm"}
    start = time.monotonic()
    while proc.poll() is None:
        time.sleep(args.every)
        log.seek(0)
        for line in log.read().splitlines():
            group = line.split(":", 1)[0]
            if group in GROUPS and group not in pids:
                pids[group] = [int(p) for p in PIDS.findall(line)]
        err.seek(0)
        steps = STEP.findall(err.read())
        if len(pids) < len(GROUPS) or not steps:
            continue
        step = int(steps[-1][0])
        everyone = [proc.pid] + [p for ps in pids.values() for p in ps]
        samples.append({"t": round(time.monotonic() - start, 1), "step": step,
                        "rss": {g: sum(rss(p) for p in ps) for g, ps in pids.items()},
                        "shm": shm_bytes(everyone)})
    if proc.returncode != 0:
        err.seek(0)
        sys.exit(f"the soak run failed:\n{err.read()[-3000:]}")
    samples = [s for s in samples if all(s["rss"].values())]  # workers end with the run
    warm = next(s for s in samples if s["step"] >= args.warmup * args.steps)
    last = samples[-1]
    growth = {g: (last["rss"][g] - warm["rss"][g]) / warm["rss"][g] for g in GROUPS}
    after = [s["shm"] for s in samples if s["step"] >= warm["step"]]
    print(f"{args.steps} steps in {last['t']:.0f} s; {len(samples)} samples; warm-up ends at step {warm['step']}")
    print(f"{'worker kind':<14} {'RSS after warm-up':>18} {'RSS at the end':>15} {'growth':>8}")
    for g in GROUPS:
        print(f"{g:<14} {warm['rss'][g] / 1e6:>15.1f} MB {last['rss'][g] / 1e6:>12.1f} MB {growth[g]:>8.2%}")
    print("/dev/shm bytes of the run over time (step: MB):")
    print("  " + ", ".join(f"{s['step']}: {s['shm'] / 1e6:.2f}" for s in samples[::max(1, len(samples) // 12)]))
    figures = {"steps": args.steps, "wall_s": last["t"],
               **{f"rss_growth_{g.removesuffix('Group').lower()}": round(v, 4) for g, v in growth.items()},
               "shm_mb_after_warmup_min": round(min(after) / 1e6, 3),
               "shm_mb_after_warmup_max": round(max(after) / 1e6, 3),
               "rss_growth_under_5_percent": all(v < 0.05 for v in growth.values()),
               "shm_flat": max(after) == min(after)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
