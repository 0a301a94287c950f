"""Channels: named, keyed FIFO queues that carry bulk data between worker processes.

A channel (``env.channel.name``) holds one FIFO queue per key, e.g. ``"obs_buffer/0"``. The part
of a key before its first ``/`` is the queue name (``queue_name``), which picks the queue's bound
(``queue_size``; 0 = unbounded, a bounded queue makes producers wait). Payloads are nested dicts,
lists and tuples of numpy arrays, torch tensors, strings and scalars.

Same node: array data goes through shared memory. Each producing process keeps a pool of
segments ("slots") and reuses them; a message is one copy into a free slot, and the consumer
receives arrays that are views of that slot, so array data is never pickled and, once the pool is
warm, nothing is allocated per message. A slot returns to its producer's pool when the consumer
drops every array of the message. The queue of a key is a ring in shared memory guarded by
``flock`` (the kernel releases it if a holder dies) with futex waits: a message costs no RPC.

Across nodes: a key lives on the node of the first process that touches it (a small Ray actor
records this); a process on another node reaches it through a Ray actor on that node, and the
data travels through Ray's object store.

Cleanup: every segment is named ``embch.<host>.<creator pid>.<channel id>...``. The process that
created the channel unlinks them on ``close()`` and at exit (also after an exception, Ctrl-C or
SIGTERM, and whatever killed producers left); creating a channel also removes the segments of
channels whose creator is no longer alive (a driver killed with SIGKILL), as does the runner
once its workers are gone (env workers name their observation blocks the same way). Linux only
(``/dev/shm``, futex).
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import hashlib
import mmap
import os
import pickle
import platform
import re
import secrets
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

SHM_DIR = "/dev/shm"
PREFIX = "embch"
UNBOUNDED_CAPACITY = 1 << 16  # ring entries of a `queue_size: 0` queue (1 MiB); producers wait beyond
SLOT_GRANULE = 1 << 16  # slot sizes are rounded up to this, so similar messages share slots
ALIGN = 64
HEADER = 64  # bytes before a queue's ring and before a slot's metadata

# Queue header: magic u32 @0, put_seq u32 @4 (futex: an item was added), get_seq u32 @8 (futex:
# an item was taken), capacity u32 @12, bound u32 @16, head u64 @24, tail u64 @32.
_MAGIC = 0x454D4251
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEAD_TAIL = struct.Struct("<QQ")
_ENTRY = struct.Struct("<II")  # (producer pid, slot number)
_PUT_SEQ, _GET_SEQ = 4, 8
# Slot header: state u8 @0 (0 free, 1 in flight or held by a consumer), metadata length u32 @4.
_FREE, _BUSY = 0, 1


class ChannelError(RuntimeError):
    """A channel cannot be created or used (no shared memory, full /dev/shm, closed channel)."""


def _align(n: int, to: int = ALIGN) -> int:
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


def _get_futex() -> _Futex:
    global _futex
    if _futex is None:
        _futex = _Futex()
    return _futex


def _shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE faults the pages in once here instead of on the first copy of every message.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def _create_segment(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new segment of ``size`` bytes; FileExistsError if another process made it first."""
    fd = os.open(_shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve the memory now: a full /dev/shm fails here with a message, not with SIGBUS later.
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        os.close(fd)
        os.unlink(_shm_path(name))
        raise ChannelError(
            f"cannot reserve {size} bytes in {SHM_DIR} ({err.strerror}); free space there or "
            "enlarge it (docker: --shm-size)"
        ) from None
    return fd, _map(fd, size)


def _unlink_prefix(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix``; returns how many."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(_shm_path(name))
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


_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32]


def creator_prefix(pid: int) -> str:
    """The start of the name of every segment of the channels that process ``pid`` of this host
    created. The host is part of it: containers may share /dev/shm but not their pids."""
    return f"{PREFIX}.{_HOST}.{pid}."


def sweep_dead_channels() -> int:
    """Remove segments of channels whose creating process (on this host) is gone; returns how many."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == [PREFIX, _HOST] and parts[2].isdigit():
            if not _alive(int(parts[2])):
                removed += _unlink_prefix(creator_prefix(int(parts[2])))
    return removed


class _Queue:
    """One key's FIFO: a ring of (pid, slot) entries in a shared segment."""

    def __init__(self, name: str, bound: int) -> None:
        capacity = bound or UNBOUNDED_CAPACITY
        try:
            self._fd, self._mm = _create_segment(name, HEADER + _ENTRY.size * capacity)
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
        self._futex = _get_futex()

    @staticmethod
    def _attach(name: str) -> tuple[int, mmap.mmap]:
        fd = os.open(_shm_path(name), os.O_RDWR)
        deadline = time.monotonic() + 10.0
        while True:
            size = os.fstat(fd).st_size
            if size:
                mm = _map(fd, size)
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


class _Slot:
    __slots__ = ("number", "mm", "capacity")

    def __init__(self, number: int, mm: mmap.mmap, capacity: int) -> None:
        self.number, self.mm, self.capacity = number, mm, capacity


class _Leaf:
    """Placeholder for the ``index``-th array of a message in its pickled skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return _Leaf, (self.index,)


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _flatten(item: Any, leaves: list) -> Any:
    """The item with every array and tensor replaced by a ``_Leaf``; those go into ``leaves``."""
    if isinstance(item, np.ndarray) and not item.dtype.hasobject:
        leaves.append(item)
        return _Leaf(len(leaves) - 1)
    if _is_tensor(item):
        leaves.append(item.detach())
        return _Leaf(len(leaves) - 1)
    if type(item) is dict:
        return {k: _flatten(v, leaves) for k, v in item.items()}
    if type(item) in (list, tuple):
        return type(item)(_flatten(v, leaves) for v in item)
    return item


def _fill(skeleton: Any, leaves: list) -> Any:
    if isinstance(skeleton, _Leaf):
        return leaves[skeleton.index]
    if type(skeleton) is dict:
        return {k: _fill(v, leaves) for k, v in skeleton.items()}
    if type(skeleton) in (list, tuple):
        return type(skeleton)(_fill(v, leaves) for v in skeleton)
    return skeleton


def _release(mm: mmap.mmap) -> None:
    """Hand a slot back to its producer: called when the last array of a message is dropped."""
    try:
        mm[0] = _FREE
    except ValueError:  # mapping already closed at interpreter exit
        pass


class _Local:
    """What one process holds of one channel: its queues, its slot pool, slots it has mapped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[str, _Queue] = {}
        self.pool: list[_Slot] = []
        self.next_slot = 0
        self.mapped: dict[str, mmap.mmap] = {}
        self.homes: dict[str, str] = {}
        self.node: str | None = None

    def close(self) -> None:
        for queue in self.queues.values():
            queue.close()
        self.queues.clear()
        self.pool.clear()
        self.mapped.clear()  # mappings close once the arrays that view them are gone


_LOCALS: dict[str, _Local] = {}
_LOCALS_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    # A forked child must not share its parent's slot pool or locks.
    global _LOCALS_LOCK
    _LOCALS.clear()
    _LOCALS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


@ray.remote(num_cpus=0)
class _Homes:
    """Which node each key of a multi-node channel lives on: the first to ask claims it."""

    def __init__(self) -> None:
        self._homes: dict[str, str] = {}

    def claim(self, key: str, node: str) -> str:
        return self._homes.setdefault(key, node)


@ray.remote(num_cpus=0, max_concurrency=64)
class _NodeAgent:
    """Puts and gets on behalf of processes on other nodes; the data crosses via the object store."""

    def put(self, channel: Channel, key: str, item: Any, timeout: float | None) -> None:
        channel._put_local(key, item, timeout)

    def get(self, channel: Channel, key: str, timeout: float | None) -> Any:
        return channel._get_local(key, timeout)

    def cleanup(self, prefix: str) -> int:
        return _unlink_prefix(prefix)


class Channel:
    """Handle of a channel; picklable, so the driver creates it and passes it to workers."""

    def __init__(
        self,
        name: str,
        prefix: str,
        bounds: int | dict[str, int],
        homes: Any = None,
        agents: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self._prefix = prefix
        self._bounds = bounds
        self._homes = homes
        self._agents = agents
        self._owner_pid: int | None = None

    @classmethod
    def create(cls, name: str, maxsize: int | Mapping[str, int] = 0) -> Channel:
        """Create a channel. ``maxsize``: one bound for every key, or a bound per queue name
        (``{"obs_buffer": 0, "action_buffer": 2}``, from ``<role>.channel.queue_size``)."""
        if not os.path.isdir(SHM_DIR):
            raise ChannelError(f"channel {name!r}: shared-memory channels need {SHM_DIR} (Linux)")
        _get_futex()
        bounds = _check_bounds(name, maxsize)
        sweep_dead_channels()
        tag = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:32]
        prefix = f"{creator_prefix(os.getpid())}{secrets.token_hex(4)}.{tag}."
        homes = agents = None
        if ray.is_initialized():
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            if len(nodes) > 1:
                here = ray.get_runtime_context().get_node_id()
                homes = _Homes.options(scheduling_strategy=_on(here)).remote()
                agents = {n: _NodeAgent.options(scheduling_strategy=_on(n)).remote() for n in nodes}
        channel = cls(name, prefix, bounds, homes, agents)
        channel._owner_pid = os.getpid()
        atexit.register(channel.close)
        _exit_cleanly_on_sigterm()
        return channel

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_owner_pid"] = None  # only the creating process cleans up
        return state

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self._bounds!r})"

    # -- public API -------------------------------------------------------------------------

    def put(self, key: str, item: Any, timeout: float | None = None) -> None:
        """Append ``item`` to the queue of ``key``; waits while a bounded queue is full
        (TimeoutError after ``timeout`` seconds)."""
        agent = self._remote_agent(key)
        if agent is None:
            self._put_local(key, item, timeout)
        else:
            ray.get(agent.put.remote(self, key, item, timeout))

    def get(self, key: str, timeout: float | None = None) -> Any:
        """Take the oldest item of ``key``, waiting for one (TimeoutError after ``timeout``
        seconds). On one node its arrays are views of shared memory, returned to the producer's
        pool when the last of them is dropped: keep them as long as needed, copy to keep forever."""
        agent = self._remote_agent(key)
        if agent is None:
            return self._get_local(key, timeout)
        return ray.get(agent.get.remote(self, key, timeout))

    def qsize(self, key: str) -> int:
        """Number of items waiting in the queue of ``key`` (on this node)."""
        return self._queue(key).qsize()

    def close(self) -> None:
        """Release this process's mappings; in the creating process also remove every segment of
        the channel, on every node. Arrays already received stay valid."""
        with _LOCALS_LOCK:
            local = _LOCALS.pop(self._prefix, None)
        if local is not None:
            local.close()
        if self._owner_pid != os.getpid():
            return
        self._owner_pid = None
        if self._agents and ray.is_initialized():
            # a node already gone took its segments' processes with it: ask only the live ones
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            refs = [a.cleanup.remote(self._prefix) for n, a in self._agents.items() if n in alive]
            ray.wait(refs, num_returns=len(refs), timeout=10)
            for actor in [self._homes, *self._agents.values()]:
                ray.kill(actor)
        _unlink_prefix(self._prefix)

    # -- same node --------------------------------------------------------------------------

    def _local(self) -> _Local:
        local = _LOCALS.get(self._prefix)
        if local is None:
            with _LOCALS_LOCK:
                local = _LOCALS.setdefault(self._prefix, _Local())
        return local

    def _bound(self, key: str) -> int:
        if isinstance(self._bounds, int):
            return self._bounds
        queue_name = key.split("/", 1)[0]
        if queue_name not in self._bounds:
            raise KeyError(
                f"channel {self.name!r}: key {key!r} names queue {queue_name!r}, which has no "
                f"queue_size; the channel's queues are {sorted(self._bounds)}"
            )
        return self._bounds[queue_name]

    def _queue(self, key: str) -> _Queue:
        local = self._local()
        queue = local.queues.get(key)
        if queue is None:
            with local.lock:
                queue = local.queues.get(key)
                if queue is None:
                    digest = hashlib.sha1(key.encode()).hexdigest()[:20]
                    queue = local.queues[key] = _Queue(f"{self._prefix}q{digest}", self._bound(key))
        return queue

    def _slot(self, local: _Local, need: int) -> _Slot:
        """A free slot of this process with room for ``need`` bytes, made if there is none."""
        with local.lock:
            best = None
            for slot in local.pool:
                if slot.capacity >= need and slot.mm[0] == _FREE:
                    if best is None or slot.capacity < best.capacity:
                        best = slot
            if best is None:
                capacity = _align(need, SLOT_GRANULE)
                number = local.next_slot
                local.next_slot += 1
                fd, mm = _create_segment(self._slot_name(os.getpid(), number), capacity)
                os.close(fd)
                best = _Slot(number, mm, capacity)
                local.pool.append(best)
            best.mm[0] = _BUSY
            return best

    def _slot_name(self, pid: int, number: int) -> str:
        return f"{self._prefix}s{pid}.{number}"

    def _put_local(self, key: str, item: Any, timeout: float | None) -> None:
        queue = self._queue(key)
        leaves: list = []
        skeleton = _flatten(item, leaves)
        layout, offset = [], 0
        for leaf in leaves:
            if isinstance(leaf, np.ndarray):
                layout.append((False, leaf.dtype, leaf.shape, offset, leaf.nbytes))
                offset += _align(leaf.nbytes)
            else:
                nbytes = leaf.numel() * leaf.element_size()
                layout.append((True, leaf.dtype, tuple(leaf.shape), offset, nbytes))
                offset += _align(nbytes)
        meta = pickle.dumps((skeleton, layout), protocol=pickle.HIGHEST_PROTOCOL)
        data_at = _align(HEADER + len(meta))
        slot = self._slot(self._local(), data_at + offset)
        mm = slot.mm
        try:
            _U32.pack_into(mm, 4, len(meta))
            mm[HEADER : HEADER + len(meta)] = meta
            for leaf, (is_tensor, dtype, shape, at, nbytes) in zip(leaves, layout):
                if not nbytes:
                    continue
                if is_tensor:
                    import torch

                    dst = torch.frombuffer(mm, dtype=dtype, count=leaf.numel(), offset=data_at + at)
                    dst.view(shape).copy_(leaf)
                else:
                    np.copyto(np.ndarray(shape, dtype, buffer=mm, offset=data_at + at), leaf)
            deadline = None if timeout is None else time.monotonic() + timeout
            sent = queue.put((os.getpid(), slot.number), deadline)
        except BaseException:
            mm[0] = _FREE
            raise
        if not sent:
            mm[0] = _FREE
            raise TimeoutError(
                f"channel {self.name!r}: queue {key!r} stayed full ({self._bound(key)} items) "
                f"for {timeout}s"
            )

    def _get_local(self, key: str, timeout: float | None) -> Any:
        queue = self._queue(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        entry = queue.get(deadline)
        if entry is None:
            raise TimeoutError(f"channel {self.name!r}: nothing arrived on {key!r} within {timeout}s")
        mm = self._mapped(self._slot_name(*entry))
        meta_len = _U32.unpack_from(mm, 4)[0]
        skeleton, layout = pickle.loads(mm[HEADER : HEADER + meta_len])
        if not layout:
            _release(mm)
            return skeleton
        data_at = _align(HEADER + meta_len)
        base = np.frombuffer(mm, np.uint8)
        weakref.finalize(base, _release, mm)
        leaves = []
        for is_tensor, dtype, shape, at, nbytes in layout:
            raw = base[data_at + at : data_at + at + nbytes]
            if is_tensor:
                import torch

                leaves.append(torch.from_numpy(raw).view(dtype).view(shape))
            else:
                leaves.append(raw.view(dtype).reshape(shape))
        return _fill(skeleton, leaves)

    def _mapped(self, name: str) -> mmap.mmap:
        local = self._local()
        mm = local.mapped.get(name)
        if mm is None:
            try:
                fd = os.open(_shm_path(name), os.O_RDWR)
            except FileNotFoundError:
                raise ChannelError(f"channel {self.name!r} was closed (segment {name} is gone)") from None
            try:
                mm = local.mapped[name] = _map(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        return mm

    # -- across nodes -----------------------------------------------------------------------

    def _remote_agent(self, key: str):
        """The agent on the node that holds ``key``, or None when that is this node."""
        if self._homes is None:
            return None
        local = self._local()
        home = local.homes.get(key)
        if local.node is None:
            local.node = ray.get_runtime_context().get_node_id()
        here = local.node
        if home is None:
            home = local.homes[key] = ray.get(self._homes.claim.remote(key, here))
        return None if home == here else self._agents[home]


def _exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (kill, docker stop, Slurm) into SystemExit so that atexit cleanup runs,
    unless the program has its own handler."""
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _check_bounds(name: str, maxsize: int | Mapping[str, int]) -> int | dict[str, int]:
    def check(value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"channel {name!r}: {what}={value!r}; expected an integer >= 0 (0 = unbounded)"
            )
        return value

    if isinstance(maxsize, Mapping):
        return {str(q): check(v, f"{q}.queue_size") for q, v in maxsize.items()}
    return check(maxsize, "queue_size")
