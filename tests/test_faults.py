"""Faults that lose nothing: a worker of each kind killed with SIGKILL mid-step ends the run
within 30 s with one line naming group, rank and node; the run leaves no shared memory (the
suite's conftest checks /dev/shm after every test); the last checkpoint loads; and
``runner.resume_dir=auto`` goes on from it. The runs overlap rollout and update
(``algorithm.staleness_threshold=1``), so every kill lands mid-overlap, with one side possibly
waiting on the other; resuming regenerates the rollout that was in flight (synchronous runs
resume exactly: tests/test_pipeline.py)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from embodied import checkpoint
from tests.runs import Run, tiny_config

pytestmark = pytest.mark.slow
ENDS_WITHIN_S = 30.0


def kill_mid_run(run: Run, group: str, ckpts, after_step: int) -> None:
    """Once the run has checkpointed a step beyond ``after_step``, SIGKILL ``group``'s rank 0
    and check how the run ends."""
    run.wait_for(lambda: (c := checkpoint.latest(ckpts)) is not None
                 and checkpoint.read_trainer_state(c)["step"] > after_step)
    (pid, node), *_ = run.pids(group)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    code, _ = run.finish(timeout=60)
    assert time.monotonic() - killed < ENDS_WITHIN_S
    assert code == 1
    line = run.last_error_line()
    assert line.startswith(f"embodied-train: {group} rank 0 on node {node} ("), line
    last = checkpoint.latest(ckpts)
    torch.load(last / "actor" / "model.pt", weights_only=True)  # intact
    torch.load(last / "actor" / "optimizer.pt", weights_only=False)


def test_killed_env_rollout_and_actor_workers_end_the_run_and_resume_continues(tmp_path):
    """One run after the other, each resuming the last one's checkpoint: kill an env worker,
    then a rollout worker, then an actor rank; a last run finishes two more steps."""
    args = tiny_config(tmp_path / "config") + [f"runner.output_dir={tmp_path}", "runner.resume_dir=auto",
                                               "algorithm.staleness_threshold=1",
                                               "algorithm.loss_type=decoupled_actor_critic"]
    ckpts = tmp_path / "tiny" / "checkpoints"
    step = 0
    for i, group in enumerate(("EnvGroup", "RolloutGroup", "ActorGroup")):
        run = Run(args, tmp_path, f"run{i}")
        if step:
            run.wait_for(lambda: f"resumed from {ckpts / f'global_step_{step}'} at step {step}"
                         in run.stdout.read_text())
        kill_mid_run(run, group, ckpts, step)
        step = checkpoint.read_trainer_state(checkpoint.latest(ckpts))["step"]
    run = Run(args + [f"runner.max_epochs={step + 2}"], tmp_path, "last")
    code, err = run.finish(timeout=240)
    assert code == 0, err[-3000:]
    assert f"resumed from {ckpts / f'global_step_{step}'} at step {step}" in run.stdout.read_text()
    result = json.loads(run.stdout.read_text().strip().splitlines()[-1])
    assert result["env_steps"] == (step + 2) * 2 * 10
    assert checkpoint.latest(ckpts).name == f"global_step_{step + 2}"
