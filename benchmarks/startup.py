"""Time from ``Runner(...)`` to workers ready: the env, rollout and actor groups built one after
another (the baseline: each group's ``__init__`` waited for before the next group starts) against
all three at once (``Runner._launch``: ``WorkerGroup.launch(wait=False)`` then ``ready``).

The run is the shipped ``maniskill_ppo_mlp`` (PushCube, state observations, FSDP2 actor on both
CPU slots), on one Ray cluster kept for the whole benchmark, so that only the groups' start is
timed: the env workers start their simulator processes and build the scenes, the rollout workers
build the policy, the actor ranks join their gloo group and shard the policy. Rounds alternate
the two orders; the ratio is the median of the per-round ratios.

    flock /tmp/bench.lock .venv/bin/python benchmarks/startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embodied import runner as runner_module  # noqa: E402
from embodied.cli import load  # noqa: E402
from embodied.runner import Runner  # noqa: E402
from embodied.worker import WorkerGroup  # noqa: E402

PARALLEL = Runner._launch


def one_after_another(self, cfg, plan) -> None:
    """The baseline: as ``Runner._launch``, each group waited for before the next starts."""
    launch = WorkerGroup.launch

    def waiting(*args, **kwargs):
        return launch(*args, **{**kwargs, "wait": True})

    runner_module.WorkerGroup.launch = waiting
    try:
        PARALLEL(self, cfg, plan)
    finally:
        runner_module.WorkerGroup.launch = launch


def time_start(cfg, plan, launch) -> float:
    Runner._launch = launch
    try:
        tic = time.monotonic()
        runner = Runner(cfg, plan)  # its Cluster joins the Ray started in main
        seconds = time.monotonic() - tic
        runner.close()
        return seconds
    finally:
        Runner._launch = PARALLEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg, plan = load("maniskill_ppo_mlp", [f"runner.output_dir={out}"])
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        time_start(cfg, plan, PARALLEL)  # warm the machine's file cache
        baseline, ours, ratios = [], [], []
        for r in range(args.rounds):
            order = [(one_after_another, baseline), (PARALLEL, ours)]
            for launch, into in order if r % 2 == 0 else order[::-1]:
                into.append(time_start(cfg, plan, launch))
            ratios.append(baseline[-1] / ours[-1])
            print(f"round {r + 1}: one after another {baseline[-1]:.1f} s, together {ours[-1]:.1f} s", flush=True)
        ray.shutdown()
    print(json.dumps({"one_after_another_s": round(statistics.median(baseline), 2),
                      "together_s": round(statistics.median(ours), 2),
                      "startup_speedup": round(statistics.median(ratios), 2)}))


if __name__ == "__main__":
    main()
