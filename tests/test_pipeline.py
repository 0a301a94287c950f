"""End to end through Ray workers, channels and real ManiSkill: training, evaluation, resume
after SIGKILL, and a dead env worker."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from embodied import checkpoint

pytestmark = pytest.mark.slow


def tiny(out: Path, name: str = "tiny") -> list[str]:
    """PPO on PushCube with 4 envs and 10-step episodes: seconds per step."""
    return [
        f"runner.output_dir={out}", f"runner.experiment_name={name}", "runner.val_check_interval=-1",
        "env.train.total_num_envs=4", "env.train.max_episode_steps=10", "env.train.auto_reset=false",
        "env.eval.total_num_envs=4", "env.eval.max_episode_steps=10",
        "actor.global_batch_size=20", "actor.micro_batch_size=10", "algorithm.update_epochs=2",
    ]


def embodied(command: str, args: list[str], timeout: float = 600) -> tuple[dict, subprocess.CompletedProcess]:
    done = subprocess.run([sys.executable, "-m", "embodied", command, *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def scalars(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def test_train_then_evaluate_a_checkpoint(tmp_path):
    result, done = embodied("train", tiny(tmp_path) + ["runner.max_epochs=2"])
    assert result["env_steps"] == 2 * 4 * 10 and result["wall_s"] > 0
    assert "train:" in done.stderr  # the progress bar
    step = checkpoint.latest(tmp_path / "tiny" / "checkpoints")
    assert step.name == "global_step_2"
    weights = torch.load(step / "actor" / "model.pt", weights_only=True)
    assert any("value_head" in k for k in weights)
    losses = scalars(tmp_path / "tiny", "actor/policy_loss")
    assert sorted(losses) == [1, 2]

    result, done = embodied("eval", tiny(tmp_path) + [f"runner.ckpt_path={tmp_path / 'tiny' / 'checkpoints'}"])
    assert result["episodes"] == 4
    assert 0.0 <= result["eval_success"] <= 1.0
    assert "eval of" in done.stdout and "over 4 episodes" in done.stdout


def test_pipelined_rollout_plays_the_same_episodes(tmp_path):
    """With rollout.pipeline_stage_num=2 each env worker's envs form two stages that take turns
    with the policy; every env must still get the actions for its own observations, so greedy
    episodes of one checkpoint are the same as without stages."""
    embodied("train", tiny(tmp_path) + ["runner.max_epochs=1"])
    returns = {}
    for stages in (1, 2):
        name = f"stages{stages}"
        embodied("eval", tiny(tmp_path, name) + [
            f"runner.ckpt_path={tmp_path / 'tiny' / 'checkpoints'}", "env.eval.total_num_envs=8",
            f"rollout.pipeline_stage_num={stages}"])
        returns[stages] = scalars(tmp_path / name, "eval/return")
    # exact: the same per-env returns (deterministic CPU physics), averaged in the same order
    assert returns[1] == returns[2] and returns[1][1] != 0.0


def test_cnn_policy_trains_from_camera_images(tmp_path):
    """maniskill_ppo_cnn: rgb observations through the env, rollout and actor workers."""
    args = ["--config-name", "maniskill_ppo_cnn", *tiny(tmp_path, "cnn"), "runner.max_epochs=2",
            "runner.save_interval=1"]
    result, _ = embodied("train", args)
    assert result["env_steps"] == 2 * 4 * 10
    for tag in ("actor/policy_loss", "critic/value_loss", "actor/grad_norm"):
        values = scalars(tmp_path / "cnn", tag)
        assert sorted(values) == [1, 2] and all(math.isfinite(v) for v in values.values()), (tag, values)
    ckpts = tmp_path / "cnn" / "checkpoints"
    assert checkpoint.latest(ckpts).name == "global_step_2"
    first, second = (torch.load(ckpts / f"global_step_{n}" / "actor" / "model.pt", weights_only=True)
                     for n in (1, 2))
    conv = "image_encoder.0.0.weight"  # the first conv layer: image features are trained
    assert first[conv].shape == (32, 3, 8, 8) and not torch.equal(first[conv], second[conv])


def _env_worker_pids(driver: int) -> list[int]:
    """Env workers are the parents of the forkserver that starts their simulator processes;
    the embedded Ray cluster, and so every worker, descends from the driver."""
    forkservers = {p.pid: p.ppid() for p in psutil.Process(driver).children(recursive=True)
                   if "multiprocessing.forkserver" in " ".join(p.cmdline())}
    # the simulator processes forked by a forkserver look like it; their parent gives them away
    return sorted({parent for parent in forkservers.values() if parent not in forkservers})


def test_dead_env_worker_ends_the_run_with_a_clear_error(tmp_path):
    args = tiny(tmp_path) + ["runner.max_epochs=1000", "runner.save_interval=1"]
    proc = subprocess.Popen([sys.executable, "-m", "embodied", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ckpts = tmp_path / "tiny" / "checkpoints"
        deadline = time.monotonic() + 300
        while checkpoint.latest(ckpts) is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        pids = _env_worker_pids(proc.pid)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        assert time.monotonic() - killed < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "EnvGroup rank" in err.strip().splitlines()[-1]
    last = checkpoint.latest(ckpts)
    torch.load(last / "actor" / "model.pt", weights_only=True)  # the last checkpoint is intact
