"""``actor.optim.use_distributed_optimizer``: the optimizer's state, and mixed precision's fp32 main
weights, sharded over the data-parallel replicas, so that each holds about 1/DP of them (Megatron's
distributed optimizer, ZeRO stage 1). Here a whole parameter belongs to one replica (largest first,
each to the replica holding the fewest values so far); that replica's optimizer alone keeps its
state and steps it, and broadcasts the stepped parameter to the others. Gradients are all-reduced
as without it (Megatron reduce-scatters them: each replica then holds only its shard's sums; the
sums are the same), and the clip's norm adds up every replica's own parameters. Checkpoints hold
each parameter's state once, written by its owner, and load at any data-parallel size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from policies.megatron.training import WrappedOptimizer, buckets


def owners(params: list[Tensor], replicas: int) -> list[int]:
    """The replica that steps each parameter: the same answer on every rank."""
    load = [0] * replicas
    owner = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner[index] = min(range(replicas), key=load.__getitem__)
        load[owner[index]] += params[index].numel()
    return owner


class ShardedOptimizer(WrappedOptimizer):
    """The optimizer (``build`` over this replica's share of ``groups``) that steps this replica's
    parameters, then gathers everyone's: what the trainer sees of a torch optimizer."""

    def __init__(self, groups: list[dict[str, Any]], build: Callable[[list[dict[str, Any]]], Any],
                 group: dist.ProcessGroup) -> None:
        self.group = group
        self.params = [p for g in groups for p in g["params"]]
        mine, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
        owner = owners(self.params, len(ranks))
        self.sources = [ranks[o] for o in owner]  # each parameter's owner, as a global rank
        ours = {id(p) for p, o in zip(self.params, owner) if o == mine}
        self.inner = build([{**g, "params": [p for p in g["params"] if id(p) in ours]} for g in groups])

    @property
    def model_params(self) -> list[Tensor]:
        """The model parameters this replica's state belongs to (a checkpoint shards it like them)."""
        return getattr(self.inner, "model_params", None) or [p for g in self.inner.param_groups for p in g["params"]]

    @property
    def main_params(self) -> list[Tensor]:
        return getattr(self.inner, "main_params", [])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:  # every gradient: the all-reduce sums all of them
            param.grad = None
        self.inner.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.inner.step()
        self.gather()

    @torch.no_grad()
    def gather(self) -> None:
        """Every parameter as its owner holds it."""
        for source in sorted(set(self.sources)):
            owned = [p.data for p, s in zip(self.params, self.sources) if s == source]
            for bucket in buckets(owned):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.broadcast(flat, src=source, group=self.group)
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                    t.copy_(part.view_as(t))

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        self.gather()  # mixed precision's owners took their main weights: so does everyone else
