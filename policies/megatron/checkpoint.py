"""Megatron ``dist_checkpointing`` folders of a GPTModel (and of its torch optimizer): every
rank writes its own shards with their global offsets, so a folder saved at one tensor-parallel
size loads at another. A collective: every rank of the job calls these functions.

The vocab-split tensors keep their padding (``weights.padded_vocab_size``), so their global
shape depends on the TP size; Megatron marks them ``allow_shape_mismatch``, and a load reads the
rows both sizes have and zero-fills the rest (e.g. 16 rows at TP 2, 15 at TP 1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from core.errors import CheckpointError
from policies.megatron import cpu

METADATA = "metadata.json"  # dist_checkpointing's marker file of a saved folder


def _strategy() -> Any:
    return cpu.host_save_strategy() if cpu.needed() else None  # None: Megatron's default


def save(model: nn.Module, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``model``'s shards (and ``optimizer``'s state, resharded like the parameters) to
    the folder ``path``."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"], _ = _optimizer_sharded_state(model, optimizer, state["model"])
    dist_checkpointing.save(state, str(path), sharded_strategy=_strategy())


def load_model_state(model: nn.Module, path: str | Path) -> dict[str, Tensor]:
    """The weights of folder ``path`` resharded for this rank, as ``model.state_dict()`` names
    (the modules' ``_extra_state`` entries left out)."""
    template = {"model": model.sharded_state_dict()}
    return {k: v for k, v in _load(template, path)["model"].items() if not k.endswith("._extra_state")}


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Restore ``optimizer``'s state from folder ``path`` (saved with an optimizer, at any TP size
    and, with the distributed optimizer, at any data-parallel size)."""
    _ensure_state(optimizer)
    template, keys = _optimizer_sharded_state(model, optimizer, model.sharded_state_dict())
    loaded = _load({"optimizer": template}, path)["optimizer"]
    steps = loaded.pop("steps")
    for index, state in loaded["state"].items():
        # (folders written before the steps were keyed by parameter keyed them by state index)
        state["step"] = torch.tensor(float(steps[keys[index]] if keys[index] in steps else steps[index]))
    loaded["param_groups"] = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict(loaded)


def _load(template: dict[str, Any], path: str | Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not (Path(path) / METADATA).is_file():
        raise CheckpointError(f"{path} is not a Megatron dist_checkpointing folder (no {METADATA})")
    try:
        return dist_checkpointing.load(template, str(path), strict=StrictHandling.RAISE_UNEXPECTED)
    except Exception as error:  # Megatron raises CheckpointingException, torch ValueError/RuntimeError
        raise CheckpointError(f"{path} does not match this model: {error}") from error


def _optimizer_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                             model_state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, str]]:
    """The optimizer's per-parameter tensors (Adam's moments, mixed precision's main weights)
    sharded like their parameters, with the step counts alongside by parameter; and each state
    index's parameter key (for a load). A distributed optimizer's replica holds the only copy of
    its parameters' state: it writes them, whatever its data-parallel rank."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    # mixed precision's optimizer steps main weights: its state is sharded like the model's parameters
    params = getattr(optimizer, "model_params", None) or [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state_dict()
    shards = get_param_id_to_sharded_param_map(model_state, params)
    group = getattr(optimizer, "group", None)  # the distributed optimizer's data-parallel group
    if group is not None:
        shards = {i: replace(t, replica_id=(*t.replica_id[:-1], 0)) for i, t in shards.items()}
    steps = {shards[i].key: float(s["step"]) for i, s in state["state"].items() if "step" in s}
    if group is not None:  # the steps go in the common part, which rank 0 writes: everyone's
        every: list[dict[str, float]] = [{} for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather_object(every, steps, group=group)
        steps = {k: v for part in every for k, v in part.items()}
    keys = {i: t.key for i, t in shards.items()}
    optim_state_to_sharding_state(state, shards, exclude_keys=("step",))
    state["steps"] = steps
    return state, keys


@torch.no_grad()
def _ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its per-parameter state (zeros) so there is a template to load
    into: one step at learning rate 0 with zero gradients, which leaves the weights as they are."""
    if optimizer.state:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, g in zip(params, grads):
        p.grad = g
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
