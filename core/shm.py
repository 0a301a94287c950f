"""Naming of the shared-memory segments the project makes (channels, env observation blocks),
and their cleanup: every name is ``embch.<host>.<creator pid>.<...>``, so segments whose creating
process is gone can be found and removed even after a SIGKILL. Linux only (``/dev/shm``)."""

from __future__ import annotations

import os
import re
import socket

SHM_DIR = "/dev/shm"
PREFIX = "embch"
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32]


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink_prefix(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix``; returns how many."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(shm_path(name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def creator_prefix(pid: int) -> str:
    """The start of the name of every segment that process ``pid`` of this host created. The
    host is part of it: containers may share /dev/shm but not their pids."""
    return f"{PREFIX}.{_HOST}.{pid}."


def sweep_dead_segments() -> int:
    """Remove segments whose creating process (on this host) is gone; returns how many."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == [PREFIX, _HOST] and parts[2].isdigit():
            if not _alive(int(parts[2])):
                removed += unlink_prefix(creator_prefix(int(parts[2])))
    return removed
