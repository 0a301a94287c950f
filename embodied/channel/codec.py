"""A message as a pickled skeleton plus its arrays: every numpy array and torch tensor of a
nested payload (dicts, lists, tuples, dataclasses such as ``embodied.batch.Trajectory``) is
replaced by a placeholder, so that only the small skeleton is pickled and the arrays are copied
into shared memory as they are."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np


class _Leaf:
    """Placeholder for the ``index``-th array of a message in its pickled skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return _Leaf, (self.index,)


class _Fields:
    """Placeholder for a dataclass: its class and its fields' skeletons."""

    __slots__ = ("cls", "values")

    def __init__(self, cls: type, values: dict[str, Any]) -> None:
        self.cls, self.values = cls, values

    def __reduce__(self):
        return _Fields, (self.cls, self.values)


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def flatten(item: Any, leaves: list) -> Any:
    """The item with every array and tensor replaced by a ``_Leaf``; those go into ``leaves``."""
    if isinstance(item, np.ndarray) and not item.dtype.hasobject:
        leaves.append(item)
        return _Leaf(len(leaves) - 1)
    if _is_tensor(item):
        leaves.append(item.detach())
        return _Leaf(len(leaves) - 1)
    if type(item) is dict:
        return {k: flatten(v, leaves) for k, v in item.items()}
    if type(item) in (list, tuple):
        return type(item)(flatten(v, leaves) for v in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return _Fields(type(item), {f.name: flatten(getattr(item, f.name), leaves) for f in dataclasses.fields(item)})
    return item


def fill(skeleton: Any, leaves: list) -> Any:
    if isinstance(skeleton, _Leaf):
        return leaves[skeleton.index]
    if type(skeleton) is dict:
        return {k: fill(v, leaves) for k, v in skeleton.items()}
    if type(skeleton) in (list, tuple):
        return type(skeleton)(fill(v, leaves) for v in skeleton)
    if isinstance(skeleton, _Fields):
        return skeleton.cls(**{k: fill(v, leaves) for k, v in skeleton.values.items()})
    return skeleton
