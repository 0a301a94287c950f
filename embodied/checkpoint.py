"""Checkpoint folders that are either complete or invisible.

A step is written into ``global_step_<N>.partial`` by whoever owns the state (the driver, each
actor rank) and becomes ``global_step_<N>`` by one atomic rename once everyone has finished, so
a run killed mid-write leaves nothing that ``latest`` would pick. Each step carries the resolved
config of its run (``config.yaml``), so that evaluating or exporting it needs only its path, and
the size of every file it holds (``files`` in ``trainer_state.json``), so that a step damaged after
its rename (a file truncated or removed) is never resumed from: ``latest`` passes over it and
``resolve`` names the file.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from core.errors import CheckpointError


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (e.g. a full disk); the previous one stays the latest."""


STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
ACTOR_DIR = "actor"  # the actor ranks' part of a step: the policy's weights in its own layout


def partial_dir(root: str | Path, step: int) -> Path:
    """Fresh folder that the writers of step ``step`` fill before ``commit``."""
    path = Path(root) / f"global_step_{step}.partial"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def commit(root: str | Path, step: int, trainer_state: dict[str, Any], keep: int = -1,
           config: str | None = None) -> Path:
    """Write the driver's state and the run's resolved ``config`` (YAML), make the step visible
    atomically, drop the oldest beyond ``keep``."""
    root = Path(root)
    partial = root / f"global_step_{step}.partial"
    if config is not None:
        (partial / CONFIG_FILE).write_text(config)
    files = {str(f.relative_to(partial)): f.stat().st_size for f in sorted(partial.rglob("*")) if f.is_file()}
    _write_json(partial / TRAINER_STATE, {"step": step, **trainer_state, "files": files})
    _fsync_tree(partial)
    final = root / f"global_step_{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync_dir(root)
    if keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` whose files are all there, whole."""
    for folder in reversed(list_checkpoints(root)):
        if damage(folder) is None:
            return folder
    return None


def damage(step_dir: Path) -> str | None:
    """What is wrong with a committed step's files (missing or of another size than written),
    or None when they are whole. Steps written before the sizes were recorded pass."""
    try:
        files = read_trainer_state(step_dir).get("files", {})
    except (OSError, ValueError) as err:
        return f"{step_dir / TRAINER_STATE} is unreadable ({err})"
    for name, size in files.items():
        file = step_dir / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} holds {file.stat().st_size} bytes, {size} were written"
    return None


def resolve(path: str | Path, key: str) -> Path:
    """A checkpoint named by the user: a step folder, or a folder of steps (the latest whole one
    wins). ``key`` names the config key in the error (a ``FileNotFoundError`` when nothing is
    there, a ``CheckpointError`` for a step that is incomplete or damaged)."""
    path = Path(path)
    if path.name.endswith(".partial"):
        newest = latest(path.parent)
        raise CheckpointError(
            f"{key}={str(path)!r} is a checkpoint whose writing never finished (the run stopped while "
            f"saving it), so it is not resumed from; the latest complete one there is {newest}")
    if (path / TRAINER_STATE).is_file():
        if (why := damage(path)) is not None:
            raise CheckpointError(f"{key}={str(path)!r} is damaged: {why}; the latest whole one "
                                  f"beside it is {latest(path.parent)}")
        return path
    newest = latest(path)
    if newest is None:
        raise FileNotFoundError(
            f"{key}={str(path)!r}: no complete checkpoint there (expected a global_step_<N> folder "
            f"holding {TRAINER_STATE}, or a folder of them)"
        )
    return newest


def read_trainer_state(step_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(step_dir) / TRAINER_STATE).read_text())


def read_config(step_dir: str | Path) -> dict[str, Any] | None:
    """The resolved config a step was trained with; None for a checkpoint written before steps
    carried it."""
    file = Path(step_dir) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        config = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise CheckpointError(f"{file} is not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} holds no config mapping")
    return config


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch generators, so a resumed run draws what the uninterrupted one would."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
