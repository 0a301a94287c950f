"""Shared-memory segments and the futexes that wake their waiters (Linux, x86_64 or aarch64)."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys

from core.shm import SHM_DIR, shm_path

ALIGN = 64
HEADER = 64  # bytes before a queue's ring and before a slot's metadata


class ChannelError(RuntimeError):
    """A channel cannot be created or used (no shared memory, full /dev/shm, closed channel)."""


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word of a shared mapping (process-shared futexes)."""

    _SYSCALL = {"x86_64": 202, "aarch64": 98}

    def __init__(self) -> None:
        machine = platform.machine()
        if sys.platform != "linux" or machine not in self._SYSCALL:
            raise ChannelError(
                f"shared-memory channels need Linux on x86_64 or aarch64, not {sys.platform}/{machine}"
            )
        self._nr = self._SYSCALL[machine]
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long

    def wait(self, addr: int, expected: int, timeout: float) -> None:
        ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
        self._syscall(
            ctypes.c_long(self._nr), ctypes.c_void_p(addr), ctypes.c_int(0),
            ctypes.c_int(expected), ctypes.byref(ts), None, ctypes.c_int(0),
        )

    def wake(self, addr: int) -> None:
        self._syscall(
            ctypes.c_long(self._nr), ctypes.c_void_p(addr), ctypes.c_int(1),
            ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0),
        )


_futex: _Futex | None = None


def get_futex() -> _Futex:
    global _futex
    if _futex is None:
        _futex = _Futex()
    return _futex


def map_segment(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE faults the pages in once here instead of on the first copy of every message.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def create_segment(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new segment of ``size`` bytes; FileExistsError if another process made it first."""
    fd = os.open(shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve the memory now: a full /dev/shm fails here with a message, not with SIGBUS later.
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        os.close(fd)
        os.unlink(shm_path(name))
        raise ChannelError(
            f"cannot reserve {size} bytes in {SHM_DIR} ({err.strerror}); free space there or "
            "enlarge it (docker: --shm-size)"
        ) from None
    return fd, map_segment(fd, size)
