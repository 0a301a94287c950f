"""Per-episode statistics for logging: an env worker feeds every ``chunk_step``'s infos in and
takes out means over the episodes that finished since it last asked."""

from __future__ import annotations

from typing import Any

import numpy as np

FIELDS = ("return", "length", "success", "success_once")
_SOURCES = {"return": "episode_return", "length": "episode_length", "success": "success",
            "success_once": "success_once"}


class EpisodeStats:
    """Collects return, length, success (at the episode's end) and success_once (at any step)
    of each finished episode, from the ``infos`` of ``VectorEnv.chunk_step``."""

    def __init__(self) -> None:
        self._episodes: dict[str, list[float]] = {f: [] for f in FIELDS}

    def update(self, infos: dict[str, Any]) -> int:
        """Record the episodes that ended in this chunk (``infos["done"]``); returns how many."""
        done = np.asarray(infos["done"], bool)
        for field, key in _SOURCES.items():
            self._episodes[field].extend(np.asarray(infos[key], np.float64)[done].tolist())
        return int(done.sum())

    @property
    def num_episodes(self) -> int:
        return len(self._episodes["return"])

    def episodes(self) -> dict[str, np.ndarray]:
        """Every recorded episode's figures, e.g. to gather across workers before averaging."""
        return {f: np.asarray(v) for f, v in self._episodes.items()}

    def pop(self, prefix: str = "env/") -> dict[str, float]:
        """Means over the recorded episodes (plus their count), then forget them; empty when no
        episode finished."""
        n = self.num_episodes
        summary = ({f"{prefix}{f}": float(np.mean(v)) for f, v in self._episodes.items()}
                   | {f"{prefix}episodes": float(n)}) if n else {}
        self._episodes = {f: [] for f in FIELDS}
        return summary
