"""The Ray cluster the workers run on, and the devices it offers to the placement plan.

With no address (``cluster.ray_address`` null and no ``RAY_ADDRESS``) an embedded local Ray
cluster is started, sized by Ray to the machine. With an address, the driver joins a cluster made
with ``ray start --head`` on one node and ``ray start --address=<head>:6379`` on the others.

Devices are GPUs when the nodes have them (``cluster.num_gpus_per_node``: null = what Ray
detects), else CPU slots (one per CPU Ray sees on a node). Ray does the placing: each node gets a
placement group pinned to it, with one bundle per device (``{"GPU": 1}`` or ``{"CPU": 1}``), and
a rank runs in the bundle of its device. Groups that share a device split its bundle evenly, so
collocated groups always fit: with env, rollout and actor on ``all`` of a 2-core machine, each
rank asks for a third of a CPU slot. Node 0 is the driver's node; the others follow by address.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from embodied.placement import Device, PlacementError, PlacementPlan, plan_placement

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("cluster.num_nodes", "cluster.num_gpus_per_node", "cluster.ray_address")

# Ray warns at every start of a local cluster that it enabled token authentication (its secure
# default, which the cluster keeps); known harmless, so that one line is dropped. Its warning of a
# cluster started without authentication stays.
logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
    lambda record: not record.getMessage().startswith("Token authentication is enabled"))

NODE_JOIN_TIMEOUT_S = 60.0  # how long a joined cluster may take to show cluster.num_nodes nodes
RESERVE_TIMEOUT_S = 60.0  # how long Ray may take to reserve a node's devices
LOCAL_START_ATTEMPTS = 3  # starts of a local Ray node before its failure is the run's
_RESOURCE_STEPS = 10_000  # Ray counts resources in steps of 1e-4


class ClusterError(RuntimeError):
    """The Ray cluster does not match ``cluster.*`` or cannot give the devices asked for."""


# how ray.init says its local node did not come up: the raylet exits when Ray's metrics agent takes
# over a fixed 15 s to start (ray-project/ray#65983); the driver's first GCS query times out (seen
# in the full suite, two runs starting beside three busy test processes). A loaded machine does both.
_START_FAILURES = ("timed out during startup", "Failed to connect to GCS")


def _start_local_ray(attempts: int = LOCAL_START_ATTEMPTS) -> None:
    """``ray.init`` of a local cluster, started again when its node does not come up
    (``_START_FAILURES``). A failed start's processes are stopped before the next."""
    for attempt in range(1, attempts + 1):
        before = _child_pids()
        try:
            ray.init(address="local", include_dashboard=False)
            return
        except Exception as err:  # Ray raises a bare Exception for this
            if not any(failure in str(err) for failure in _START_FAILURES) or attempt == attempts:
                raise
            ray.shutdown()
            for pid in _child_pids() - before:
                with contextlib.suppress(ProcessLookupError, ChildProcessError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            print(f"the local Ray node did not start ({' '.join(str(err).split())}); starting it again "
                  f"({attempt + 1} of {attempts})", file=sys.stderr)


def _child_pids() -> set[int]:
    """This process's children, from /proc (empty where the kernel does not list them)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError):
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids


class Cluster:
    """A started or joined Ray cluster; shut it down with ``shutdown()`` (or use ``with``)."""

    def __init__(
        self,
        num_nodes: int = 1,
        ray_address: str | None = None,
        num_gpus_per_node: int | None = None,
    ) -> None:
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ClusterError(f"cluster.num_nodes={num_nodes!r}; expected an integer >= 1")
        if num_gpus_per_node is not None and (
            isinstance(num_gpus_per_node, bool)
            or not isinstance(num_gpus_per_node, int)
            or num_gpus_per_node < 0
        ):
            raise ClusterError(
                f"cluster.num_gpus_per_node={num_gpus_per_node!r}; expected null (auto) or an "
                "integer >= 0"
            )
        self.num_nodes = num_nodes
        self.address = ray_address or os.environ.get("RAY_ADDRESS") or None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if self.address is None and num_nodes > 1:
                raise ClusterError(
                    f"cluster.num_nodes={num_nodes} needs a multi-node Ray cluster: run "
                    "`ray start --head` on one node and `ray start --address=<head>:6379` on the "
                    "others, then set cluster.ray_address (or RAY_ADDRESS)"
                )
            try:
                if self.address is None:
                    _start_local_ray()
                else:
                    ray.init(address=self.address, include_dashboard=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise ClusterError(
                    f"cannot join the Ray cluster at cluster.ray_address={self.address!r}: {err}"
                ) from err
        self.node_ids = self._wait_for_nodes()
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        self._addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        used = [nodes[i] for i in self.node_ids]
        gpus = min(int(r.get("GPU", 0)) for r in used)
        if num_gpus_per_node is None:
            num_gpus_per_node = gpus
        elif num_gpus_per_node > gpus:
            raise ClusterError(
                f"cluster.num_gpus_per_node={num_gpus_per_node} but a node of the Ray cluster has "
                f"only {gpus} GPU(s)"
            )
        if num_gpus_per_node > 0:
            self.accelerator, self.devices_per_node = "gpu", num_gpus_per_node
        else:
            self.accelerator = "cpu"
            self.devices_per_node = min(int(r.get("CPU", 0)) for r in used)
            if self.devices_per_node < 1:
                raise ClusterError("a node of the Ray cluster offers no CPU to Ray")
        self._groups: dict[int, PlacementGroup] = {}
        self._claims: dict[Device, dict[str, float]] = {}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Cluster:
        """From the ``cluster`` config node (``num_nodes``, ``ray_address``, ``num_gpus_per_node``)."""
        keys = ("num_nodes", "ray_address", "num_gpus_per_node")
        return cls(**{k: cfg[k] for k in keys if k in cfg})

    def _wait_for_nodes(self) -> list[str]:
        deadline = time.monotonic() + (NODE_JOIN_TIMEOUT_S if self.address else 0.0)
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= self.num_nodes:
                break
            if time.monotonic() >= deadline:
                where = f"at {self.address}" if self.address else "started locally"
                raise ClusterError(
                    f"cluster.num_nodes={self.num_nodes} but the Ray cluster {where} has "
                    f"{len(alive)} node(s); start Ray on the others with "
                    "`ray start --address=<head>:6379`, or lower cluster.num_nodes"
                )
            time.sleep(1.0)
        here = ray.get_runtime_context().get_node_id()
        alive.sort(key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))
        return [n["NodeID"] for n in alive[: self.num_nodes]]

    def plan(self, placement: Mapping[str, str | int]) -> PlacementPlan:
        """Resolve ``cluster.component_placement`` against this cluster's devices."""
        return plan_placement(placement, self.num_nodes, self.devices_per_node, self.accelerator)

    def describe(self) -> str:
        unit = "GPU" if self.accelerator == "gpu" else "CPU slot"
        where = self.address or "embedded local cluster"
        return f"Ray: {where}, {self.num_nodes} node(s) x {self.devices_per_node} {unit}(s)"

    # -- used by WorkerGroup ----------------------------------------------------------------

    def claim(self, group: str, plan: PlacementPlan, component: str) -> list[dict[str, Any]]:
        """Reserve ``component``'s share of each of its devices for ``group``; returns the Ray
        actor options of each rank. A device is split evenly among the plan's components on it."""
        if (plan.num_nodes, plan.devices_per_node, plan.accelerator) != (
            self.num_nodes, self.devices_per_node, self.accelerator
        ):
            raise PlacementError(
                f"the placement plan is for {plan.num_nodes} node(s) x {plan.devices_per_node} "
                f"{plan.accelerator} device(s), but the cluster has {self.num_nodes} x "
                f"{self.devices_per_node} {self.accelerator}; make it with Cluster.plan()"
            )
        devices = plan.devices(component)
        shares = []
        for device in devices:
            sharing = sum(device in devs for devs in plan.components.values())
            share = math.floor(_RESOURCE_STEPS / sharing) / _RESOURCE_STEPS
            held = self._claims.get(device, {})
            if sum(held.values()) + share > 1 + 0.5 / _RESOURCE_STEPS:
                raise PlacementError(
                    f"cannot place {group} on device {device.local} of node {device.node}: it is "
                    f"already fully used by {sorted(held)} (shut those groups down, or launch all "
                    "collocated groups from one placement plan)"
                )
            shares.append(share)
        options = []
        for device, share in zip(devices, shares):
            self._claims.setdefault(device, {})[group] = share
            strategy = PlacementGroupSchedulingStrategy(
                self._reserve(device.node), placement_group_bundle_index=device.local
            )
            if self.accelerator == "gpu":
                options.append(dict(scheduling_strategy=strategy, num_gpus=share, num_cpus=0))
            else:
                options.append(dict(scheduling_strategy=strategy, num_cpus=share))
        return options

    def release(self, group: str) -> None:
        """Give back what ``claim`` reserved for ``group``."""
        for held in self._claims.values():
            held.pop(group, None)

    def node_id(self, node: int) -> str:
        return self.node_ids[node]

    def node_label(self, node: int) -> str:
        """``node <index> (<address>)``, for messages about a worker on that node."""
        return f"node {node} ({self._addresses.get(self.node_ids[node], '?')})"

    def _reserve(self, node: int) -> PlacementGroup:
        """The placement group holding every device of node ``node`` (made on first use)."""
        if node not in self._groups:
            resource = "GPU" if self.accelerator == "gpu" else "CPU"
            bundles = [{resource: 1.0}] * self.devices_per_node
            selector = [{"ray.io/node-id": self.node_ids[node]}] * self.devices_per_node
            pg = placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=selector)
            ready, _ = ray.wait([pg.ready()], timeout=RESERVE_TIMEOUT_S)
            if not ready:
                remove_placement_group(pg)
                raise ClusterError(
                    f"Ray could not reserve {self.devices_per_node} {resource}(s) on node {node} "
                    f"within {RESERVE_TIMEOUT_S:.0f}s; free now: {ray.available_resources()} "
                    "(is another job holding them?)"
                )
            self._groups[node] = pg
        return self._groups[node]

    def shutdown(self) -> None:
        """Drop the reservations; stop Ray if this object started or joined it."""
        for pg in self._groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # Ray already gone
                pass
        self._groups.clear()
        self._claims.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
