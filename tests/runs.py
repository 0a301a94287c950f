"""Helpers of the end-to-end tests: commands run in this process on the session's Ray cluster
(``embodied``), and for the fault and multi-node tests a tiny PPO config with the env, rollout and
actor groups on separate devices, runs started as subprocesses, and their workers' pids."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from embodied.config.schema import CONFIG_DIR

# PPO on PushCube, 2 envs, 10-step episodes: about a second per step once started.
TINY = f"""\
defaults:
  - base
  - env/maniskill_push_cube@env.train
  - env/maniskill_push_cube@env.eval
  - model/mlp@actor.model
  - _self_
hydra:
  searchpath: [file://{CONFIG_DIR}]
cluster:
  component_placement:
    env: {{env}}
    rollout: {{rollout}}
    actor: {{actor}}
runner:
  experiment_name: tiny
  max_epochs: 1000
  val_check_interval: -1
  save_interval: 1
actor:
  micro_batch_size: 10
  global_batch_size: 20
env:
  train: {{{{total_num_envs: 2, max_episode_steps: 10}}}}
  eval: {{{{total_num_envs: 2, max_episode_steps: 10}}}}
"""
PIDS = re.compile(r"rank (\d+) pid (\d+) on node (\d+)")


def embodied(command: str, args: list[str], code: int = 0) -> tuple[dict, subprocess.CompletedProcess]:
    """``embodied-<command> <args>`` (train, eval or export) in this process, on the Ray cluster of the
    ``ray_session`` fixture: what ``python -m embodied`` prints and returns, without a fresh
    interpreter and Ray cluster per run. Returns the last line's JSON (empty without one: a dry run,
    an error) and the output; asserts the exit code. A run that must be killed stays a subprocess
    (``Run``)."""
    from embodied import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if command == "eval":
            returned = cli._main(args, "embodied-eval", evaluation=True, extra=["runner.only_eval=true"])
        elif command == "export":
            returned = cli._export(args, "embodied-export")
        else:
            returned = cli._main(args, "embodied-train")
    done = subprocess.CompletedProcess(["embodied", command, *args], returned, out.getvalue(), err.getvalue())
    assert done.returncode == code, done.stderr[-3000:]
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return (json.loads(last) if last.startswith("{") else {}), done


def placed(**groups: str) -> list[str]:
    """Overrides that replace the experiment's ``cluster.component_placement`` with ``groups``
    (``placed(actor="all", env="0", rollout="0")``): a test that is not about ranks runs one rank
    per group, which halves a short run's start (worker imports and model builds on 2 cores)."""
    lines = ",".join(f"{group}:{devices}" for group, devices in groups.items())
    return ["~cluster.component_placement", f"+cluster.component_placement={{{lines}}}"]


ONE_RANK_EACH = placed(actor="0", env="0", rollout="0")
TWO_ACTOR_RANKS = placed(actor="all", env="0", rollout="0")  # FSDP2 sharding over gloo, per-rank state
TWO_ENV_WORKERS = placed(actor="0", env="all", rollout="0")  # per-worker files, reset states split over workers


def tiny_config(folder: Path, env: str = "0", rollout: str = "1", actor: str = "0-1") -> list[str]:
    """Write the tiny experiment with this placement; returns the CLI arguments that pick it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.yaml").write_text(TINY.format(env=env, rollout=rollout, actor=actor))
    return ["--config-path", str(folder), "--config-name", "tiny"]


class Run:
    """``python -m embodied train ...`` in the background, its output in files. With
    ``ray_address`` (the ``ray_session`` fixture's) the run joins that Ray cluster, as a second
    driver, instead of starting one of its own: for runs whose workers die but whose driver
    does not."""

    def __init__(self, args: list[str], out: Path, name: str, ray_address: str | None = None) -> None:
        self.stdout, self.stderr = out / f"{name}.out", out / f"{name}.err"
        env = {**os.environ, "RAY_ADDRESS": ray_address} if ray_address else None
        with open(self.stdout, "w") as o, open(self.stderr, "w") as e:
            self.proc = subprocess.Popen([sys.executable, "-m", "embodied", "train", *args],
                                         stdout=o, stderr=e, env=env)

    def wait_for(self, predicate, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None, self.stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.1)

    def pids(self, group: str, launch: int = 0) -> list[tuple[int, int]]:
        """(pid, node) of each rank of ``group``, from the line the runner prints at its
        ``launch``-th start (0: the first; a restart starts every group again)."""
        lines = [line for line in self.stdout.read_text().splitlines() if line.startswith(f"{group}: ")]
        if len(lines) <= launch:
            return []
        return [(int(pid), int(node)) for _, pid, node in PIDS.findall(lines[launch])]

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.returncode, self.stderr.read_text()

    def last_error_line(self) -> str:
        return self.stderr.read_text().strip().splitlines()[-1]


def on_two_gloo_ranks(fn) -> dict:
    """``fn(rank, results)`` in two spawned processes, each a rank of a gloo process group on
    127.0.0.1; returns what they put in the shared ``results`` dict."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_gloo_rank, args=(fn, port, results), nprocs=2)
        return dict(results)


def _gloo_rank(rank: int, fn, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        fn(rank, results)
    finally:
        dist.destroy_process_group()
