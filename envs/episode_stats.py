"""Per-episode statistics for logging: an env worker feeds every ``chunk_step``'s infos in and
takes out means over the episodes that finished since it last asked, overall and per task."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

FIELDS = ("return", "length", "success", "success_once")
_SOURCES = {"return": "episode_return", "length": "episode_length", "success": "success",
            "success_once": "success_once"}


def task_key(description: str) -> str:
    """A task's name in metric keys: its description's lowercase words joined by ``_`` (no
    spaces or slashes, which TensorBoard and the ``<split>/<figure>/<task>`` scheme reject)."""
    return "_".join(re.findall(r"[a-z0-9]+", description.lower())) or "task"


class EpisodeStats:
    """Collects return, length, success (at the episode's end), success_once (at any step) and
    the task of each finished episode, from the ``infos`` of ``VectorEnv.chunk_step``."""

    def __init__(self) -> None:
        self._episodes: dict[str, list[float]] = {f: [] for f in FIELDS}
        self._tasks: list[str] = []

    def update(self, infos: dict[str, Any]) -> int:
        """Record the episodes that ended in this chunk (``infos["done"]``), except extra
        episodes that only fill a batch (``infos["extra_episode"]``); returns how many."""
        done = np.asarray(infos["done"], bool) & ~np.asarray(infos.get("extra_episode", False), bool)
        for field, key in _SOURCES.items():
            self._episodes[field].extend(np.asarray(infos[key], np.float64)[done].tolist())
        self._tasks.extend(task_key(t) for t, d in zip(infos["task_descriptions"], done) if d)
        return int(done.sum())

    @property
    def num_episodes(self) -> int:
        return len(self._episodes["return"])

    def episodes(self) -> dict[str, np.ndarray]:
        """Every recorded episode's figures, e.g. to gather across workers before averaging."""
        return {f: np.asarray(v) for f, v in self._episodes.items()}

    def pop(self, prefix: str = "env/") -> dict[str, float]:
        """Means over the recorded episodes (plus their count), and each task's success_once
        and count as ``<prefix>success_once/<task>`` and ``<prefix>episodes/<task>``; then
        forget them. Empty when no episode finished."""
        n = self.num_episodes
        summary = ({f"{prefix}{f}": float(np.mean(v)) for f, v in self._episodes.items()}
                   | {f"{prefix}episodes": float(n)}) if n else {}
        tasks = np.asarray(self._tasks)
        success = np.asarray(self._episodes["success_once"])
        for task in sorted(set(self._tasks)):
            mine = tasks == task
            summary[f"{prefix}success_once/{task}"] = float(success[mine].mean())
            summary[f"{prefix}episodes/{task}"] = float(mine.sum())
        self._episodes = {f: [] for f in FIELDS}
        self._tasks = []
        return summary
