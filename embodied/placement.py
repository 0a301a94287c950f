"""``cluster.component_placement``: which devices each worker group gets.

Each line maps one or more component names (``"actor,env,rollout"``) to device ranks that are
global across nodes: ``all``, ``3``, ``0,2,3``, ``0-3`` or ``0-3,5,14``. Global rank ``g`` is
local device ``g % devices_per_node`` on node ``g // devices_per_node``. On a machine without
GPUs the devices are CPU slots. Rank ``i`` of a component runs on its ``i``-th device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["collocated", "disaggregated", "hybrid"]


class PlacementError(ValueError):
    """A malformed or impossible ``cluster.component_placement``."""


@dataclass(frozen=True, order=True)
class Device:
    node: int
    local: int


@dataclass(frozen=True)
class PlacementPlan:
    accelerator: Literal["gpu", "cpu"]
    num_nodes: int
    devices_per_node: int
    components: dict[str, tuple[Device, ...]]
    mode: Mode
    ranks: dict[str, int] = field(init=False)  # each component's world size

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", {name: len(devs) for name, devs in self.components.items()})

    def devices(self, component: str) -> tuple[Device, ...]:
        if component not in self.components:
            raise PlacementError(
                f"cluster.component_placement has no entry for {component!r}; "
                f"it places {sorted(self.components)}"
            )
        return self.components[component]

    def describe(self) -> str:
        unit = "GPU" if self.accelerator == "gpu" else "CPU slot"
        lines = [
            f"placement: {self.mode}, {self.num_nodes} node(s) x "
            f"{self.devices_per_node} {unit}(s)"
        ]
        for name, devs in self.components.items():
            where = ", ".join(f"n{d.node}:{d.local}" for d in devs)
            lines.append(f"  {name}: {len(devs)} rank(s) on [{where}]")
        return "\n".join(lines)


def parse_ranks(spec: str | int, total: int, key: str) -> tuple[int, ...]:
    """Global device ranks named by one placement value, in order, without repeats."""
    text = str(spec).strip()
    where = f"cluster.component_placement.{key}={spec!r}"
    if text == "all":
        return tuple(range(total))
    ranks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo_text, sep, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise PlacementError(
                f"{where}: {part!r} is not a device rank; expected 'all', an integer, "
                "a list like '0,2,3', a range like '0-3', or a mix like '0-3,5'"
            ) from None
        if lo < 0 or hi < lo:
            raise PlacementError(f"{where}: range {part!r} must run upwards from 0 or more")
        ranks.extend(range(lo, hi + 1))
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise PlacementError(f"{where}: device rank(s) {dup} named more than once")
    if max(ranks) >= total:
        raise PlacementError(
            f"{where}: device rank {max(ranks)} does not exist; the cluster has {total} "
            f"device(s) (ranks 0-{total - 1})"
        )
    return tuple(ranks)


def plan_placement(
    placement: Mapping[str, str | int],
    num_nodes: int,
    devices_per_node: int,
    accelerator: Literal["gpu", "cpu"],
) -> PlacementPlan:
    """Resolve every placement line to (node, local device) per rank and derive the mode."""
    total = num_nodes * devices_per_node
    components: dict[str, tuple[Device, ...]] = {}
    for key, spec in placement.items():
        ranks = parse_ranks(spec, total, key)
        devices = tuple(Device(r // devices_per_node, r % devices_per_node) for r in ranks)
        for name in (n.strip() for n in str(key).split(",")):
            if not name:
                raise PlacementError(f"cluster.component_placement: empty component name in {key!r}")
            if name in components:
                raise PlacementError(
                    f"cluster.component_placement: component {name!r} is placed twice"
                )
            components[name] = devices
    if not components:
        raise PlacementError(
            "cluster.component_placement is empty: expected lines such as 'actor,env,rollout: all'"
        )
    return PlacementPlan(accelerator, num_nodes, devices_per_node, components, _mode(components))


def _mode(components: dict[str, tuple[Device, ...]]) -> Mode:
    sets = [frozenset(d) for d in components.values()]
    if all(s == sets[0] for s in sets):
        return "collocated"
    if all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1:]):
        return "disaggregated"
    return "hybrid"
