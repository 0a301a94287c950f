"""Where the project keeps what it builds once per machine (the crash handler library, SAPIEN's
BRDF table): ``$XDG_CACHE_HOME/embodied-rl``, by default ``~/.cache/embodied-rl``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "embodied-rl"
