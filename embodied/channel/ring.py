"""One key's FIFO: a ring of ``(producer pid, slot number)`` entries in a shared segment,
guarded by ``flock`` (the kernel releases it if a holder dies), with futex waits on both ends."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import threading
import time

from core.shm import shm_path
from embodied.channel.segments import (
    HEADER,
    ChannelError,
    create_segment,
    get_futex,
    map_segment,
)

UNBOUNDED_CAPACITY = 1 << 16  # ring entries of a `queue_size: 0` queue (1 MiB); producers wait beyond

# Queue header: magic u32 @0, put_seq u32 @4 (futex: an item was added), get_seq u32 @8 (futex:
# an item was taken), capacity u32 @12, bound u32 @16, head u64 @24, tail u64 @32.
_MAGIC = 0x454D4251
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEAD_TAIL = struct.Struct("<QQ")
_ENTRY = struct.Struct("<II")  # (producer pid, slot number)
_PUT_SEQ, _GET_SEQ = 4, 8


class Ring:
    """One key's FIFO: a ring of (pid, slot) entries in a shared segment."""

    def __init__(self, name: str, bound: int) -> None:
        capacity = bound or UNBOUNDED_CAPACITY
        try:
            self._fd, self._mm = create_segment(name, HEADER + _ENTRY.size * capacity)
            _U32.pack_into(self._mm, 12, capacity)
            _U32.pack_into(self._mm, 16, bound)
            _U32.pack_into(self._mm, 0, _MAGIC)  # last: the queue is ready
        except FileExistsError:
            self._fd, self._mm = self._attach(name)
        self._capacity = _U32.unpack_from(self._mm, 12)[0]
        self._room = _U32.unpack_from(self._mm, 16)[0] or self._capacity
        self._base = ctypes.c_char.from_buffer(self._mm)
        self._addr = ctypes.addressof(self._base)
        self._lock = threading.Lock()  # flock is per open file: threads of one process need this too
        self._futex = get_futex()

    @staticmethod
    def _attach(name: str) -> tuple[int, mmap.mmap]:
        fd = os.open(shm_path(name), os.O_RDWR)
        deadline = time.monotonic() + 10.0
        while True:
            size = os.fstat(fd).st_size
            if size:
                mm = map_segment(fd, size)
                if _U32.unpack_from(mm, 0)[0] == _MAGIC:
                    return fd, mm
                mm.close()
            if time.monotonic() > deadline:
                os.close(fd)
                raise ChannelError(f"queue segment {name} was never initialised by its creator")
            time.sleep(0.001)

    def _locked_op(self, op):
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                return op()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _bump(self, offset: int) -> None:
        _U32.pack_into(self._mm, offset, (_U32.unpack_from(self._mm, offset)[0] + 1) & 0x7FFFFFFF)

    def _wait(self, offset: int, seen: int, deadline: float | None) -> bool:
        """Sleep until the word at ``offset`` moves past ``seen``; False once the deadline passed."""
        slice_s = 1.0
        if deadline is not None:
            slice_s = min(slice_s, deadline - time.monotonic())
            if slice_s <= 0:
                return False
        self._futex.wait(self._addr + offset, seen, slice_s)
        return True

    def put(self, entry: tuple[int, int], deadline: float | None) -> bool:
        def try_put():
            head, tail = _HEAD_TAIL.unpack_from(self._mm, 24)
            if tail - head >= self._room:
                return _U32.unpack_from(self._mm, _GET_SEQ)[0]
            _ENTRY.pack_into(self._mm, HEADER + _ENTRY.size * (tail % self._capacity), *entry)
            _U64.pack_into(self._mm, 32, tail + 1)
            self._bump(_PUT_SEQ)
            return None

        while (seen := self._locked_op(try_put)) is not None:
            if not self._wait(_GET_SEQ, seen, deadline):
                return False
        self._futex.wake(self._addr + _PUT_SEQ)
        return True

    def get(self, deadline: float | None) -> tuple[int, int] | None:
        def try_get():
            head, tail = _HEAD_TAIL.unpack_from(self._mm, 24)
            if head == tail:
                return False, _U32.unpack_from(self._mm, _PUT_SEQ)[0]
            entry = _ENTRY.unpack_from(self._mm, HEADER + _ENTRY.size * (head % self._capacity))
            _U64.pack_into(self._mm, 24, head + 1)
            self._bump(_GET_SEQ)
            return True, entry

        while True:
            got, value = self._locked_op(try_get)
            if got:
                self._futex.wake(self._addr + _GET_SEQ)
                return value
            if not self._wait(_PUT_SEQ, value, deadline):
                return None

    def qsize(self) -> int:
        def size():
            head, tail = _HEAD_TAIL.unpack_from(self._mm, 24)
            return tail - head

        return self._locked_op(size)

    def close(self) -> None:
        del self._base
        self._mm.close()
        os.close(self._fd)
