"""Faults that lose nothing. A run outlives workers that die: it restarts its groups and goes on
from its last checkpoint, and a worker that died of a signal leaves its backtraces in the log
folder. Without restarts (``runner.max_restarts=0``) a worker of each kind killed with SIGKILL
mid-step ends the run within 30 s with one line naming group, rank and node; the run leaves no shared memory (the
suite's conftest checks /dev/shm after every test); the last checkpoint loads; and
``runner.resume_dir=auto`` goes on from it. The runs overlap rollout and update
(``algorithm.staleness_threshold=1``), so every kill lands mid-overlap, with one side possibly
waiting on the other; resuming regenerates the rollout that was in flight (synchronous runs
resume exactly: tests/test_pipeline.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from omegaconf import OmegaConf

from embodied import checkpoint
from embodied.runner import _restart
from embodied.worker import WorkerError
from tests.runs import Run, embodied, tiny_config

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


def test_killed_env_rollout_and_actor_workers_end_the_run_and_resume_continues(tmp_path, ray_session):
    """One run after the other, each resuming the last one's checkpoint: kill an env worker,
    then a rollout worker, then an actor rank; a last run finishes two more steps. (The runs
    join the session's Ray cluster: their drivers do not die.)"""
    args = tiny_config(tmp_path / "config") + [f"runner.output_dir={tmp_path}", "runner.resume_dir=auto",
                                               "runner.max_restarts=0", "algorithm.staleness_threshold=1",
                                               "algorithm.loss_type=decoupled_actor_critic"]
    ckpts = tmp_path / "tiny" / "checkpoints"
    step = 0
    for i, group in enumerate(("EnvGroup", "RolloutGroup", "ActorGroup")):
        run = Run(args, tmp_path, f"run{i}", ray_address=ray_session)
        if step:
            run.wait_for(lambda: f"resumed from {ckpts / f'global_step_{step}'} at step {step}"
                         in run.stdout.read_text())
        kill_mid_run(run, group, ckpts, step)
        step = checkpoint.read_trainer_state(checkpoint.latest(ckpts))["step"]
    run = Run(args + [f"runner.max_epochs={step + 2}"], tmp_path, "last", ray_address=ray_session)
    code, err = run.finish(timeout=240)
    assert code == 0, err[-3000:]
    assert f"resumed from {ckpts / f'global_step_{step}'} at step {step}" in run.stdout.read_text()
    result = json.loads(run.stdout.read_text().strip().splitlines()[-1])
    assert result["env_steps"] == (step + 2) * 2 * 10
    assert checkpoint.latest(ckpts).name == f"global_step_{step + 2}"


def simulator_processes(env_worker_pid: int) -> list[psutil.Process]:
    """The env worker's simulator processes (children of its forkserver)."""
    return [p for child in psutil.Process(env_worker_pid).children()
            if "forkserver" in " ".join(child.cmdline()) for p in child.children()]


def logged_steps(log_dir) -> list[int]:
    """The steps that ``train/env_steps`` was logged at, over every event file of the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if "train/env_steps" in acc.Tags()["scalars"]:
            steps += [e.step for e in acc.Scalars("train/env_steps")]
    return sorted(steps)


def test_a_run_outlives_dead_workers_and_leaves_the_backtraces_of_a_crash(tmp_path, ray_session):
    """A simulator process of the env worker is SIGKILLed (as the OOM killer would), later an
    actor rank, later the other actor rank gets SIGABRT (what glibc's abort on heap corruption
    raises). Each time every group
    restarts and resumes from the last checkpoint; the run finishes all its steps, each step's
    metrics logged, those after a checkpoint again from the step after it. The aborted rank leaves
    gdb's native backtraces and Python's stacks of all its threads in ``crashes/``; workers that
    ended normally leave no file."""
    steps = 25  # the last kill comes after the checkpoint of step 15, the 3rd after the run's start: 10 steps on
    args = tiny_config(tmp_path / "config") + [f"runner.output_dir={tmp_path}", f"runner.max_epochs={steps}",
                                               "runner.save_interval=5"]
    run = Run(args, tmp_path, "run", ray_address=ray_session)
    log_dir, ckpts = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"

    def saved() -> int:
        last = checkpoint.latest(ckpts)
        return checkpoint.read_trainer_state(last)["step"] if last else 0

    run.wait_for(lambda: saved() >= 2)
    (env_pid, _), = run.pids("EnvGroup")
    sims = simulator_processes(env_pid)
    assert sims, "the env worker runs its simulators in subprocesses"
    sims[0].send_signal(signal.SIGKILL)
    for launch, (rank, sig) in enumerate([(0, signal.SIGKILL), (1, signal.SIGABRT)], start=1):
        run.wait_for(lambda: run.pids("ActorGroup", launch=launch))
        first = saved()
        run.wait_for(lambda: saved() > first)
        actor_pid = run.pids("ActorGroup", launch=launch)[rank][0]
        os.kill(actor_pid, sig)
    code, err = run.finish(timeout=400)
    assert code == 0, err[-3000:]
    result = json.loads(run.stdout.read_text().strip().splitlines()[-1])
    assert result["restarts"] == 3 and result["env_steps"] == steps * 2 * 10
    assert checkpoint.latest(ckpts).name == f"global_step_{steps}"
    events = [json.loads(line) for line in (log_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(e["group"], e["rank"], e["signal"]) for e in events] == [
        ("EnvGroup", 0, "SIGKILL"), ("ActorGroup", 0, None), ("ActorGroup", 1, "SIGABRT")]
    assert "restart 1 of 3: EnvGroup rank 0 on node 0 (" in err and "died: env process" in err
    for event in events:
        resumed = int(event["resumed_from"].rsplit("_", 1)[1])
        assert event["lost_steps"] == event["step"] - 1 - resumed or event["lost_steps"] == event["step"] - resumed
        assert f"resumed from {event['resumed_from']} at step {resumed}" in run.stdout.read_text()
    # every step logged, and those between a checkpoint and a crash again after the restart
    logged = logged_steps(log_dir)
    assert sorted(set(logged)) == list(range(1, steps + 1))
    assert len(logged) == steps + sum(e["lost_steps"] for e in events)
    reports = sorted((log_dir / "crashes").iterdir())
    assert [r.name for r in reports] == [f"ActorGroup_rank1_pid{actor_pid}.txt"] == [
        os.path.basename(events[2]["report"])]
    assert "restart 2 of 3: ActorGroup rank 0 on node 0 (" in err and "[no crash report: SIGKILL" in err
    text = reports[0].read_text()
    assert f"=== ActorGroup rank 1 pid {actor_pid} signal 6: native backtraces of all threads (gdb)" in text
    native = text.split("Fatal Python error")[0]
    assert native.count("\nThread ") >= 2 and "#0 " in native  # every thread, frame by frame
    assert "Fatal Python error: Aborted" in text
    assert "(most recent call first)" in text and "embodied/worker.py" in text  # Python's stacks


def test_a_crash_that_repeats_at_the_same_step_stops_the_run(tmp_path):
    """``_restart``'s choice: restart while restarts are left, unless the step that died is the
    one that died before the last restart; the message says why it stopped."""
    cfg = OmegaConf.create({"runner": {"max_restarts": 2, "logger": {"log_path": str(tmp_path)},
                                       "resume_dir": None}})
    runner = SimpleNamespace(step=7, done_step=6, ckpt_root=tmp_path / "checkpoints")
    restarts = []

    def death():
        err = WorkerError("ActorGroup", 1, "died: gone", "node 0 (127.0.0.1)")
        err.died, err.signal = True, "SIGSEGV"
        return err

    assert _restart(cfg, runner, death(), restarts) is cfg  # no checkpoint yet: from the start again
    with pytest.raises(WorkerError, match=r"\[SIGSEGV\]; step 7 died again after a restart, so the crash "
                                          r"repeats: stopping after 1 restart"):
        _restart(cfg, runner, death(), restarts)
    runner.step = 9
    _restart(cfg, runner, death(), restarts)
    runner.step = 12
    with pytest.raises(WorkerError, match=r"no restart left \(runner.max_restarts = 2\)"):
        _restart(cfg, runner, death(), restarts)
    assert len((tmp_path / "restarts.jsonl").read_text().splitlines()) == 2


@pytest.mark.usefixtures("ray_session")
def test_checkpoints_come_on_a_time_cadence_and_a_cadence_shorter_than_a_checkpoint_is_refused(tmp_path):
    """With step checkpoints off (``save_interval=-1``) a run still checkpoints every
    ``save_interval_minutes``; a cadence below what one checkpoint takes stops the run with exit
    code 2 naming the key, the checkpoint it just wrote complete. (No process dies here, so the
    runs are made in the test process.)"""
    args = tiny_config(tmp_path / "config", env="0", rollout="0", actor="0") + [
        f"runner.output_dir={tmp_path}", "runner.save_interval=-1", "runner.max_epochs=60"]
    ckpts = tmp_path / "tiny" / "checkpoints"
    embodied("train", args + ["runner.save_interval_minutes=0.06"])  # 3.6 s: a checkpoint took 0.9 s beside two other test processes
    steps = [checkpoint.read_trainer_state(c)["step"] for c in checkpoint.list_checkpoints(ckpts)]
    assert len(steps) >= 3 and steps[-1] == 60 and steps[0] < 60  # timed ones, then the final one
    _, done = embodied("train", args + ["runner.save_interval_minutes=1e-6", "runner.experiment_name=short"], code=2)
    assert re.match(r"embodied-train: config error: runner.save_interval_minutes = 1e-06: one checkpoint takes "
                    r"[\d.]+ s here, longer than the cadence; set it above [\d.]+ \(or null to checkpoint by "
                    r"runner.save_interval alone\). .*global_step_1 is complete", done.stderr.strip().splitlines()[-1])
    assert checkpoint.latest(tmp_path / "short" / "checkpoints").name == "global_step_1"


@pytest.mark.parametrize("value, says", [("-1", "expected a number >= 0"), ("1.5", "expected an integer"),
                                         ("x", "expected an integer")])
def test_max_restarts_must_be_a_count(value, says):
    from embodied.cli import load
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"runner.max_restarts = .*: {says}"):
        load("maniskill_ppo_mlp", [f"runner.max_restarts={value}"])
