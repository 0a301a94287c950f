"""Workers: one Ray actor per rank, launched as a group onto the devices of the placement plan.

The driver calls a method on every rank of a group and waits on the returned handle::

    group = WorkerGroup.launch(EnvWorker, cluster, plan, "env", name="EnvGroup", args=(cfg, channel, "train"))
    obs = group.execute("reset").wait()            # one result per rank

Before a worker's ``__init__`` runs it knows its ``rank``, ``world_size``, ``device`` and
``group_name``, and its process has the environment ``torch.distributed`` reads (``MASTER_ADDR``,
``MASTER_PORT`` on rank 0's node, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``;
on GPUs ``CUDA_VISIBLE_DEVICES`` names the rank's GPU), so ``dist.init_process_group(backend)``
needs no arguments.

No hangs: while the driver waits on any handle it also watches every other call in flight and
every live group (each rank keeps a call open that only ends when its process dies). A rank that
raises, or whose process dies, even while idle or while the driver waits on another group, ends
the wait within seconds with a ``WorkerError`` naming group, rank and node (``EnvGroup rank 0 on
node 1 (10.0.0.2) died: ...``); a whole node lost ends it the same way. Shutting a group down
waits for its processes to exit, so that the shared memory they could not release (killed,
not closed) can be swept (``core.shm.sweep_dead_segments``).

Crash reports: with ``crash_dir`` each rank writes its backtraces there when it dies of a fatal
signal (``embodied.crash_report``), and the error of a rank that died names its signal and its
report. A rank whose process depends on another (an env worker's simulator process) reports that
process's death as ``core.errors.ProcessDied``, which counts as the rank's death.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, OutOfMemoryError, RayActorError, RayError, RayTaskError

from core.errors import ProcessDied
from embodied import crash_report
from embodied.cluster import Cluster
from embodied.placement import Device, PlacementPlan

START_TIMEOUT_S = 300.0  # how long Ray may take to start a group's processes
EXIT_TIMEOUT_S = 10.0  # how long a shut-down group's processes may take to exit
# how long a rank that lost contact with another worker waits for that worker's death to show
LOST_PEER_GRACE_S = 10.0
# how long a rank that raised waits for a death that may have caused it (a collective's peer gone)
PEER_DEATH_GRACE_S = 3.0


class WorkerError(RuntimeError):
    """A rank of a worker group raised or died (``died``: its process, or one it depends on, is
    gone; ``signal``: what killed it, when known; ``report``: its crash report, when it wrote one)."""

    def __init__(self, group: str, rank: int, what: str, node: str = "") -> None:
        super().__init__(f"{group} rank {rank}{f' on {node}' if node else ''} {what}")
        self.group, self.rank, self.node = group, rank, node
        self.died = False
        self.signal: str | None = None
        self.report: str | None = None


class Worker:
    """Base class of every role's worker; one instance per rank, each in its own process."""

    group_name: str
    rank: int
    world_size: int
    device: Device
    accelerator: str

    def offload(self) -> None:
        """Release heavy state (weights, optimizer, simulator) so that a collocated group can
        use the device; ``reload`` restores it. Does nothing unless a role overrides it."""

    def reload(self) -> None:
        """Restore what ``offload`` released. Does nothing unless a role overrides it."""


@ray.remote(concurrency_groups={"watch": 1})
class _Host:
    """The Ray actor of one rank: holds the worker object and runs its methods."""

    def __init__(self, group: str, rank: int) -> None:
        self._label = f"{group}[{rank}]"
        self.worker: Worker | None = None

    def __repr__(self) -> str:  # Ray prefixes the rank's log lines with this
        return self._label

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for torch.distributed's rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def construct(self, cls: type, identity: dict, env: dict, args: tuple, kwargs: dict,
                  crash_dir: str | None) -> tuple[str, int]:
        """Build the worker; returns this process's host name and pid (for cleanup after it)."""
        if crash_dir is not None:
            crash_report.enable(crash_dir, identity["group_name"], identity["rank"])
        os.environ.update(env)
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        if identity["accelerator"] == "gpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        worker = cls.__new__(cls)
        for attr, value in identity.items():
            setattr(worker, attr, value)
        worker.__init__(*args, **kwargs)
        self.worker = worker
        return socket.gethostname(), os.getpid()

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_in_store(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """The result put in this node's object store; the caller gets only its reference (in a
        list, which ``ray.get`` leaves unresolved)."""
        return [ray.put(getattr(self.worker, method)(*args, **kwargs))]

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Never returns: its result turns into an error when this process dies."""
        threading.Event().wait()


_LIVE_GROUPS: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()
_CALLS: set[GroupCall] = set()  # held until settled, so a call nobody waits on still reports


def _watched() -> dict[ray.ObjectRef, tuple[Any, int]]:
    """Every ref the driver must watch: pending results of all calls, and the groups' watches."""
    refs: dict[ray.ObjectRef, tuple[Any, int]] = {}
    for call in list(_CALLS):
        refs.update((ref, (call, rank)) for ref, rank in call._pending.items())
    for group in list(_LIVE_GROUPS):
        refs.update((ref, (group, rank)) for ref, rank in group._watches.items())
    return refs


def _settle_first_death(timeout: float) -> None:
    """Raise the error of the first group whose process is found gone within ``timeout`` s."""
    watches = {ref: (group, rank) for group in list(_LIVE_GROUPS) for ref, rank in group._watches.items()}
    ready, _ = ray.wait(list(watches), num_returns=1, timeout=timeout) if watches else ([], [])
    if ready:
        group, rank = watches[ready[0]]
        group._settle(ready[0], rank)


class GroupCall:
    """Handle of one method call on every rank of a group."""

    def __init__(self, group: WorkerGroup, method: str, refs: list[ray.ObjectRef]) -> None:
        self.group = group
        self.method = method
        self._pending = {ref: rank for rank, ref in enumerate(refs)}
        self._results: list[Any] = [None] * len(refs)
        self._error: WorkerError | None = None
        _CALLS.add(self)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """The result of every rank, in rank order. Raises WorkerError as soon as any rank of any
        live group fails, and TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending and self._error is None:
            watched = _watched()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(watched), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(self._pending.values())
                raise TimeoutError(
                    f"{self.group.name}.{self.method}() not done after {timeout}s on rank(s) {ranks}"
                )
            owner, rank = watched[ready[0]]
            owner._settle(ready[0], rank)
        if self._error is not None:
            raise self._error
        return self._results

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not)."""
        if self._error is not None or not self._pending:
            return True
        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        return len(ready) == len(self._pending)

    def _settle(self, ref: ray.ObjectRef, rank: int) -> None:
        try:
            self._results[rank] = ray.get(ref)
            del self._pending[ref]
        except RayTaskError as err:  # before RayActorError: Ray makes it a subclass of its cause
            cause = err.cause if getattr(err, "cause", None) is not None else err
            if isinstance(cause, ProcessDied):  # a process the rank runs (a simulator's) is gone
                error = self.group._error_of(rank, f"died: {cause}")
                error.signal = cause.signal
                self.group._mark_dead(error)
                self._fail(error, err)
            # the rank may have raised because another worker died (a worker it was calling, on a
            # node that went down; a peer of its collectives, whose socket closed): that death, not
            # this rank's error, is what the user must see, and what a restart answers
            _settle_first_death(LOST_PEER_GRACE_S if isinstance(cause, RayActorError) else PEER_DEATH_GRACE_S)
            what = f"raised in {self.method}(): {type(cause).__name__}: {cause}"
            self._fail(self.group._error_of(rank, what), err)
        except ActorUnavailableError as err:  # the rank may be alive; Ray lost contact with it
            _settle_first_death(LOST_PEER_GRACE_S)
            self._fail(self.group._error_of(rank, f"could not be reached during {self.method}(): {err}"), err)
        except RayActorError as err:
            error = self.group._error_of(rank, f"died during {self.method}(): {err}")
            self.group._mark_dead(error, rank)
            self._fail(error, err)
        except OutOfMemoryError as err:  # Ray's memory monitor killed the rank's process mid-call
            error = self.group._error_of(rank, f"died during {self.method}(): killed for want of memory: {err}")
            self.group._mark_dead(error, rank)
            self._fail(error, err)
        except RayError as err:
            self._fail(self.group._error_of(rank, f"failed in {self.method}(): {err}"), err)
        if not self._pending:
            _CALLS.discard(self)

    def _fail(self, error: WorkerError, cause: BaseException) -> None:
        error.__cause__ = cause
        self._error = error
        _CALLS.discard(self)
        raise error


class WorkerGroup:
    """The ranks of one role (``EnvGroup``, ``RolloutGroup``, ``ActorGroup``), one Ray actor each."""

    def __init__(
        self,
        name: str,
        component: str,
        worker_cls: type[Worker],
        devices: tuple[Device, ...],
        hosts: list,
        cluster: Cluster,
        crash_dir: str | None = None,
    ) -> None:
        self.name = name
        self.component = component
        self.worker_cls = worker_cls
        self.devices = devices
        self.world_size = len(devices)
        self._hosts = hosts
        self._cluster = cluster
        self._watches: dict[ray.ObjectRef, int] = {}
        self._error: WorkerError | None = None
        self._processes: list[tuple[str, int]] = []  # (host name, pid) of each rank
        self._constructing: list[ray.ObjectRef] = []  # the ranks' __init__ calls until ``ready``
        self._crash_dir = crash_dir

    @classmethod
    def launch(
        cls,
        worker_cls: type[Worker],
        cluster: Cluster,
        plan: PlacementPlan,
        component: str,
        name: str | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        crash_dir: str | None = None,
        wait: bool = True,
    ) -> WorkerGroup:
        """Start one ``worker_cls(*args, **kwargs)`` per device that ``plan`` gives ``component``;
        returns once every rank's ``__init__`` has finished (WorkerError if one raised), or at
        once without ``wait`` (then ``ready`` waits, so that several groups start together). With
        ``crash_dir`` each rank leaves its backtraces there if it dies of a signal."""
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"{worker_cls!r} is not a subclass of embodied.worker.Worker")
        name = name or component
        devices = plan.devices(component)
        options = cluster.claim(name, plan, component)
        hosts = [_Host.options(**opt).remote(name, rank) for rank, opt in enumerate(options)]
        group = cls(name, component, worker_cls, devices, hosts, cluster, crash_dir)
        try:
            ip, port = GroupCall(group, "start", [hosts[0].address.remote()]).wait(START_TIMEOUT_S)[0]
            group._watches = {host.watch.remote(): rank for rank, host in enumerate(hosts)}
            _LIVE_GROUPS.add(group)
            refs = []
            for rank, (host, device) in enumerate(zip(hosts, devices)):
                on_node = [r for r, d in enumerate(devices) if d.node == device.node]
                env = {
                    "MASTER_ADDR": ip,
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(len(devices)),
                    "LOCAL_RANK": str(on_node.index(rank)),
                    "LOCAL_WORLD_SIZE": str(len(on_node)),
                }
                identity = dict(
                    group_name=name, rank=rank, world_size=len(devices), device=device,
                    accelerator=plan.accelerator,
                )
                refs.append(host.construct.remote(worker_cls, identity, env, args, kwargs or {}, crash_dir))
        except BaseException:
            group.shutdown()
            raise
        group._constructing = refs
        if wait:
            group.ready()
        return group

    def ready(self) -> WorkerGroup:
        """Wait until every rank's ``__init__`` has finished (WorkerError if one raised)."""
        if self._constructing:
            try:
                self._processes = GroupCall(self, "__init__", self._constructing).wait()
            except BaseException:
                self.shutdown()
                raise
            self._constructing = []
        return self

    def execute(self, method: str, *args: Any, **kwargs: Any) -> GroupCall:
        """Call ``method(*args, **kwargs)`` on every rank; returns at once with the handle. An
        argument that is a ``ray.ObjectRef`` (from ``execute_in_store``) reaches each rank as its
        value, fetched by that rank from the object store."""
        return GroupCall(self, method, [h.execute.remote(method, *args, **kwargs) for h in self._callable(method)])

    def execute_in_store(self, method: str, *args: Any, **kwargs: Any) -> GroupCall:
        """Like ``execute``, but each rank's result stays in Ray's object store and ``wait``
        returns references to them: passed on to another group's ``execute``, a result (e.g.
        full model weights) goes from this rank to those ranks without a copy through the driver."""
        return GroupCall(self, method, [h.execute_in_store.remote(method, *args, **kwargs)
                                        for h in self._callable(method)])

    def _callable(self, method: str) -> list:
        """The ranks' hosts, once this group is known alive and to have ``method``."""
        if self._error is not None:
            raise self._error
        if not callable(getattr(self.worker_cls, method, None)):
            raise AttributeError(f"{self.name}: {self.worker_cls.__name__} has no method {method!r}")
        return self._hosts

    def shutdown(self) -> None:
        """Stop every rank's process and give its devices back to the cluster."""
        _LIVE_GROUPS.discard(self)
        for call in [c for c in list(_CALLS) if c.group is self]:
            _CALLS.discard(call)
        self._watches = {}
        for host in self._hosts:
            ray.kill(host)
        self._hosts = []
        self._cluster.release(self.name)
        # a killed rank cannot clean up after itself: once its process is gone, whatever shared
        # memory it made is swept (core.shm.sweep_dead_segments)
        _wait_for_exit([pid for host, pid in self._processes if host == socket.gethostname()])
        for rank in range(len(self._processes)):
            if (report := self._report(rank)) is not None:
                crash_report.remove_if_empty(report)
        self._processes = []

    def describe(self) -> str:
        """One line: each rank's process id and node (what to look at when a rank misbehaves)."""
        ranks = [f"rank {r} pid {pid} on {self._cluster.node_label(d.node)}"
                 for r, ((_, pid), d) in enumerate(zip(self._processes, self.devices))]
        return f"{self.name}: " + "; ".join(ranks)

    def _settle(self, ref: ray.ObjectRef, rank: int) -> None:
        """A watch ended: the rank's process is gone."""
        try:
            ray.get(ref)
            detail = "its process exited"
        except RayError as err:
            detail = str(err)
        self._mark_dead(self._error_of(rank, f"died: {detail}"), rank)
        raise self._error

    def _error_of(self, rank: int, what: str) -> WorkerError:
        """The error of ``rank``, naming the node it ran on (index and address)."""
        return WorkerError(self.name, rank, what, self._cluster.node_label(self.devices[rank].node))

    def _mark_dead(self, error: WorkerError, rank: int | None = None) -> None:
        """The group is dead; ``rank``'s process is gone, and its crash report, if it wrote one,
        names the signal."""
        error.died = True
        if rank is not None and (report := self._report(rank)) is not None:
            error.signal = crash_report.signal_of(report)
            if error.signal is not None:
                error.report = str(report)
        self._error = error
        _LIVE_GROUPS.discard(self)

    def _report(self, rank: int) -> Path | None:
        """Where ``rank`` writes its crash report (None without ``crash_dir``, or on another host)."""
        if self._crash_dir is None or rank >= len(self._processes):
            return None
        host, pid = self._processes[rank]
        if host != socket.gethostname():
            return None
        return crash_report.report_path(self._crash_dir, self.name, rank, pid)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, {self.worker_cls.__name__}, world_size={self.world_size})"


def _wait_for_exit(pids: list[int], timeout: float = EXIT_TIMEOUT_S) -> None:
    """Wait until these processes of this host have exited (Ray's kill is asynchronous)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            time.sleep(0.05)
