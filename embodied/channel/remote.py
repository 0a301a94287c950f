"""Channels across nodes: a key lives on the node of the first process that touches it
(``Homes`` records this); a process on another node reaches it through the ``NodeAgent`` on that
node, and the data travels through Ray's object store."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from core.shm import unlink_prefix


@ray.remote(num_cpus=0)
class Homes:
    """Which node each key of a multi-node channel lives on: the first to ask claims it."""

    def __init__(self) -> None:
        self._homes: dict[str, str] = {}

    def claim(self, key: str, node: str) -> str:
        return self._homes.setdefault(key, node)


@ray.remote(num_cpus=0, max_concurrency=64)
class NodeAgent:
    """Puts and gets on behalf of processes on other nodes; the data crosses via the object store."""

    def put(self, channel: Any, key: str, item: Any, timeout: float | None) -> None:
        channel._put_local(key, item, timeout)

    def get(self, channel: Any, key: str, timeout: float | None) -> Any:
        return channel._get_local(key, timeout)

    def qsize(self, channel: Any, key: str) -> int:
        return channel._queue(key).qsize()

    def cleanup(self, prefix: str) -> int:
        return unlink_prefix(prefix)


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)
