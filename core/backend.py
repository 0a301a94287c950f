"""The training-backend contract: the steps a backend gives the actor, whatever distributes the
policy (``actor.training_backend``, registered in ``embodied/backends.py``).

One optimizer step on every actor rank, in this order (``scaler``: ``loss_scaler``'s, if any)::

    for each micro-batch:
        backend.micro_batch(policy, last)   # before its forward: sync gradients on the last?
        scaler.scale(loss).backward()
    backend.reduce_gradients(policy)       # once, after the last backward
    scaler.unscale_(optimizer)
    norm = backend.clip_gradients(policy, max_norm)   # the same norm on every rank
    scaler.step(optimizer)                 # when the norm is finite (optimizer.step() without one)
    scaler.update()

``build`` makes the policy on this rank, ``wrap`` distributes it (before the optimizer sees its
parameters), ``optimizer`` makes the optimizer over the wrapped policy's parameter groups,
``loss_scaler`` what scales the loss of low-precision training (torch's ``GradScaler`` interface),
``data_parallel_rank`` / ``data_parallel_size`` say which share of a batch this rank
trains on, ``save`` / ``load`` lay the policy and optimizer out in a checkpoint folder. The
config layer asks ``check`` before any worker starts and ``refused`` for the keys the backend
can never honour (the keys it reads are its registry entry's ``reads``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


class TrainingBackend(ABC):
    data_parallel_rank: int
    data_parallel_size: int

    @abstractmethod
    def __init__(self, cfg: Any, accelerator: str) -> None:
        """Join the actor's process group (``accelerator``: ``gpu`` or ``cpu``)."""

    @abstractmethod
    def build(self, device: torch.device) -> nn.Module:
        """The policy of this rank, on ``device``."""

    @abstractmethod
    def wrap(self, policy: nn.Module) -> nn.Module:
        """The policy distributed over the actor ranks."""

    def optimizer(self, groups: list[dict[str, Any]],
                  build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> Any:
        """The optimizer over ``groups`` (``build`` makes ``actor.optim``'s over any groups)."""
        return build(groups)

    def loss_scaler(self, optimizer: Any, device: torch.device) -> Any:
        """What scales the loss and unscales the gradients (``GradScaler``'s methods), or None."""
        return None

    @abstractmethod
    def micro_batch(self, policy: nn.Module, last: bool) -> None:
        """Before a micro-batch's forward pass; ``last``: the step's last micro-batch."""

    @abstractmethod
    def reduce_gradients(self, policy: nn.Module) -> None:
        """After the step's last backward: gradients as the whole batch gives them."""

    @abstractmethod
    def clip_gradients(self, policy: nn.Module, max_norm: float) -> float:
        """Clip to ``max_norm``; returns the norm before clipping (the same on every rank)."""

    @abstractmethod
    def save(self, policy: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None: ...

    @abstractmethod
    def load(self, policy: nn.Module, optimizer: torch.optim.Optimizer, path: Path, with_optimizer: bool) -> None: ...

    @classmethod
    def check(cls, cfg: Any, actor_ranks: int) -> None:
        """Raise ``ConfigError`` for options that cannot work with ``actor_ranks`` ranks."""

    @classmethod
    def refused(cls, cfg: Any) -> dict[str, str]:
        """Keys this backend never honours, with why (refused when set)."""
        return {}
