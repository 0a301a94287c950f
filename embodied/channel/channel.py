"""The channel: named, keyed FIFO queues that carry bulk data between worker processes.

A channel (``env.channel.name``) holds one FIFO queue per key, e.g. ``"obs_buffer/0"``. The part
of a key before its first ``/`` is the queue name (``queue_name``), which picks the queue's bound
(``queue_size``; 0 = unbounded, a bounded queue makes producers wait). Payloads are nested dicts,
lists, tuples and dataclasses of numpy arrays, torch tensors, strings and scalars (``codec``).

Same node: array data goes through shared memory. Each producing process keeps a pool of
segments ("slots") and reuses them; a message is one copy into a free slot, and the consumer
receives arrays that are views of that slot, so array data is never pickled and, once the pool is
warm, nothing is allocated per message. A slot returns to its producer's pool when the consumer
drops every array of the message. The queue of a key is a ring in shared memory (``ring``): a
message costs no RPC.

Across nodes: a key lives on one node, and processes elsewhere reach it through Ray (``remote``).

Cleanup: every segment is named ``embch.<host>.<creator pid>.<channel id>...`` (``core.shm``). The process that
created the channel unlinks them on ``close()`` and at exit (also after an exception, Ctrl-C or
SIGTERM, and whatever killed producers left); creating a channel also removes the segments of
channels whose creator is no longer alive (a driver killed with SIGKILL), as does the runner
once its workers are gone (env workers name their observation blocks the same way). Linux only
(``/dev/shm``, futex).
"""

from __future__ import annotations

import atexit
import hashlib
import mmap
import os
import pickle
import re
import secrets
import signal
import struct
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray

from core.shm import SHM_DIR, creator_prefix, shm_path, sweep_dead_segments, unlink_prefix
from embodied.channel.codec import fill, flatten
from embodied.channel.remote import Homes, NodeAgent, on_node
from embodied.channel.ring import Ring
from embodied.channel.segments import HEADER, ChannelError, align, create_segment, get_futex, map_segment

SLOT_GRANULE = 1 << 16  # slot sizes are rounded up to this, so similar messages share slots

# Slot header: state u8 @0 (0 free, 1 in flight or held by a consumer), metadata length u32 @4.
_FREE, _BUSY = 0, 1
_U32 = struct.Struct("<I")


class _Slot:
    __slots__ = ("number", "mm", "capacity")

    def __init__(self, number: int, mm: mmap.mmap, capacity: int) -> None:
        self.number, self.mm, self.capacity = number, mm, capacity


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
        self.queues: dict[str, Ring] = {}
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
        get_futex()
        bounds = _check_bounds(name, maxsize)
        sweep_dead_segments()
        tag = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:32]
        prefix = f"{creator_prefix(os.getpid())}{secrets.token_hex(4)}.{tag}."
        homes = agents = None
        if ray.is_initialized():
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            if len(nodes) > 1:
                here = ray.get_runtime_context().get_node_id()
                homes = Homes.options(scheduling_strategy=on_node(here)).remote()
                agents = {n: NodeAgent.options(scheduling_strategy=on_node(n)).remote() for n in nodes}
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
        """Number of items waiting in the queue of ``key``."""
        agent = self._remote_agent(key)
        if agent is None:
            return self._queue(key).qsize()
        return ray.get(agent.qsize.remote(self, key))

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
        unlink_prefix(self._prefix)

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

    def _queue(self, key: str) -> Ring:
        local = self._local()
        queue = local.queues.get(key)
        if queue is None:
            with local.lock:
                queue = local.queues.get(key)
                if queue is None:
                    digest = hashlib.sha1(key.encode()).hexdigest()[:20]
                    queue = local.queues[key] = Ring(f"{self._prefix}q{digest}", self._bound(key))
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
                capacity = align(need, SLOT_GRANULE)
                number = local.next_slot
                local.next_slot += 1
                fd, mm = create_segment(self._slot_name(os.getpid(), number), capacity)
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
        skeleton = flatten(item, leaves)
        layout, offset = [], 0
        for leaf in leaves:
            if isinstance(leaf, np.ndarray):
                layout.append((False, leaf.dtype, leaf.shape, offset, leaf.nbytes))
                offset += align(leaf.nbytes)
            else:
                nbytes = leaf.numel() * leaf.element_size()
                layout.append((True, leaf.dtype, tuple(leaf.shape), offset, nbytes))
                offset += align(nbytes)
        meta = pickle.dumps((skeleton, layout), protocol=pickle.HIGHEST_PROTOCOL)
        data_at = align(HEADER + len(meta))
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
        data_at = align(HEADER + meta_len)
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
        return fill(skeleton, leaves)

    def _mapped(self, name: str) -> mmap.mmap:
        local = self._local()
        mm = local.mapped.get(name)
        if mm is None:
            try:
                fd = os.open(shm_path(name), os.O_RDWR)
            except FileNotFoundError:
                raise ChannelError(f"channel {self.name!r} was closed (segment {name} is gone)") from None
            try:
                mm = local.mapped[name] = map_segment(fd, os.fstat(fd).st_size)
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
