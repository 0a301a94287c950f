"""Checkpoints are complete or invisible; resume finds the newest complete one."""

import os
import random
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from core.errors import CheckpointError
from embodied import checkpoint


def _save(root, step, keep=-1):
    folder = checkpoint.partial_dir(root, step)
    torch.save({"w": torch.full((3,), float(step))}, folder / "model.pt")
    return checkpoint.commit(root, step, {"env_steps": step * 100}, keep=keep)


def test_committed_steps_are_listed_in_order_and_read_back(tmp_path):
    for step in (2, 10, 4):
        _save(tmp_path, step)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "global_step_2", "global_step_4", "global_step_10"]
    newest = checkpoint.latest(tmp_path)
    assert checkpoint.read_trainer_state(newest) == {
        "step": 10, "env_steps": 1000, "files": {"model.pt": (newest / "model.pt").stat().st_size}}
    assert torch.load(newest / "model.pt")["w"].tolist() == [10.0, 10.0, 10.0]


def test_partial_and_foreign_folders_are_never_picked(tmp_path):
    _save(tmp_path, 3)
    checkpoint.partial_dir(tmp_path, 7)  # a writer that died before commit
    (tmp_path / "global_step_9").mkdir()  # no trainer state: not ours or not complete
    assert checkpoint.latest(tmp_path).name == "global_step_3"


def test_keep_drops_the_oldest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["global_step_4", "global_step_5"]


def test_resolve_accepts_a_step_or_its_parent_and_names_the_key(tmp_path):
    step = _save(tmp_path, 5)
    assert checkpoint.resolve(step, "runner.ckpt_path") == step
    assert checkpoint.resolve(tmp_path, "runner.ckpt_path") == step
    with pytest.raises(FileNotFoundError, match="runner.resume_dir='.*empty': no complete checkpoint"):
        checkpoint.resolve(tmp_path / "empty", "runner.resume_dir")


def test_a_half_written_or_damaged_checkpoint_is_never_resumed_from(tmp_path):
    """A ``.partial`` folder named by the user (a crash while saving, even after its trainer state
    was written) and a committed step whose file was truncated or removed afterwards are refused
    naming the folder or file; ``latest`` falls back to the newest whole step."""
    good = _save(tmp_path, 3)
    partial = checkpoint.partial_dir(tmp_path, 7)
    (partial / "trainer_state.json").write_text('{"step": 7}')
    with pytest.raises(CheckpointError, match=r"runner.resume_dir='.*global_step_7.partial' is a checkpoint "
                                              r"whose writing never finished.*global_step_3"):
        checkpoint.resolve(partial, "runner.resume_dir")
    damaged = _save(tmp_path, 5)
    with open(damaged / "model.pt", "r+b") as f:
        f.truncate(10)
    assert checkpoint.latest(tmp_path) == good
    assert checkpoint.resolve(tmp_path, "runner.resume_dir") == good
    with pytest.raises(CheckpointError, match=r"global_step_5' is damaged: .*model.pt holds 10 bytes, \d+ were "
                                              r"written; the latest whole one beside it is .*global_step_3"):
        checkpoint.resolve(damaged, "runner.resume_dir")
    (damaged / "model.pt").unlink()
    with pytest.raises(CheckpointError, match=r"model.pt is missing"):
        checkpoint.resolve(damaged, "runner.ckpt_path")


def test_rng_state_round_trip_reproduces_draws():
    state = checkpoint.rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_process_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL in the middle of writing step 2: step 1 stays the latest and loads."""
    _save(tmp_path, 1)
    writer = textwrap.dedent(f"""
        import time, torch
        from embodied import checkpoint
        folder = checkpoint.partial_dir({str(tmp_path)!r}, 2)
        torch.save({{"w": torch.zeros(1000)}}, folder / "model.pt")
        print("writing", flush=True)
        time.sleep(60)
        checkpoint.commit({str(tmp_path)!r}, 2, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    newest = checkpoint.latest(tmp_path)
    assert newest.name == "global_step_1"
    assert torch.load(newest / "model.pt")["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.fixture
def small_mount(tmp_path):
    """A real 6 MiB tmpfs (mounting needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_unwritable_log_path_is_refused_before_anything_starts(tmp_path, small_mount):
    from embodied.cli import load
    from embodied.config import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"runner.logger.log_path = '.*/file/run': expected a folder "
                                          r"that can be created, but .*/file is a file"):
        load("maniskill_ppo_mlp", [f"runner.logger.log_path={tmp_path / 'file' / 'run'}"])
    (small_mount / "run" / "checkpoints").mkdir(parents=True)
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    with pytest.raises(ConfigError, match=r"runner.logger.log_path = '.*/small/run': expected a writable "
                                          r"folder, but .*/small/run is not writable \(Read-only file system\)"):
        load("maniskill_ppo_mlp", [f"runner.logger.log_path={small_mount / 'run'}"])
    with pytest.raises(ConfigError, match=r"env.eval.video_cfg.video_base_dir = '.*/small/videos': "
                                          r"expected a writable folder"):
        load("maniskill_ppo_mlp", ["env.eval.video_cfg.save_video=true",
                                   f"env.eval.video_cfg.video_base_dir={small_mount / 'videos'}"])
    from tests.runs import embodied

    _, done = embodied("train", [f"runner.logger.log_path={small_mount / 'new'}"], code=2)
    assert "Read-only file system" in done.stderr.strip().splitlines()[-1]
    assert "Ray" not in done.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_full_disk_during_a_checkpoint_keeps_the_previous_one_and_says_so(tmp_path, small_mount):
    """Each step of the tiny run saves ~3.4 MB (weights and Adam moments); on a 6 MiB tmpfs
    step 1's fits and step 2's does not."""
    from tests.runs import embodied, tiny_config

    _, done = embodied("train", tiny_config(tmp_path, env="0", rollout="0", actor="0")
                       + [f"runner.output_dir={small_mount}"], code=1)
    line = done.stderr.strip().splitlines()[-1]
    ckpts = small_mount / "tiny" / "checkpoints"
    last = checkpoint.latest(ckpts)
    assert last.name == "global_step_1"
    assert line.startswith("embodied-train: checkpoint of step 2 not written ("), line
    assert re.search(r"; [0-2]\.\d MB free in .*/small/tiny/checkpoints; ", line)
    assert line.endswith(f"the latest checkpoint is still {last}")
    assert sorted(p.name for p in ckpts.iterdir()) == [p.name for p in checkpoint.list_checkpoints(ckpts)]
    torch.load(last / "actor" / "model.pt", weights_only=True)
    torch.load(last / "actor" / "optimizer.pt", weights_only=False)
