"""Checkpoints are complete or invisible; resume finds the newest complete one."""

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

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
    assert checkpoint.read_trainer_state(newest) == {"step": 10, "env_steps": 1000}
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
