"""What ``actor.optim`` and ``actor.fsdp_config`` turn into for the FSDP2 actor: the optimizer,
``fully_shard``'s options (mixed precision, CPU offload, resharding), autocast and loss scaling.

- ``actor.optim.optimizer``: ``adam`` (L2 ``weight_decay`` added to the gradient), ``adamw``
  (decoupled ``weight_decay``), both with ``adam_beta1/2`` and ``adam_eps``; ``sgd`` (plain,
  with ``weight_decay``; the Adam keys must stay at their defaults).
- ``actor.fsdp_config.mixed_precision.param_dtype / reduce_dtype``: FSDP2's
  ``MixedPrecisionPolicy`` (parameters gathered and computed in ``param_dtype``, gradients reduced
  in ``reduce_dtype``; the sharded master weights and the optimizer stay fp32).
- ``actor.fsdp_config.amp_autocast``: ``torch.autocast`` around the policy's forward pass in
  training (bf16 or fp16, on CPU or GPU); losses are computed in fp32.
- ``actor.fsdp_config.grad_scaler``: dynamic loss scaling for fp16 autocast (torch's
  ``GradScaler``, on CPU too; with FSDP2 an inf in any rank's shard skips the step on every rank).
- ``actor.fsdp_config.cpu_offload`` (+ ``offload_pin_memory`` on GPU): FSDP2's
  ``CPUOffloadPolicy``, sharded parameters, gradients and optimizer state live in host memory.
- ``actor.fsdp_config.sharding_strategy``: ``full_shard`` (FSDP2's default), ``shard_grad_op``
  (parameters stay gathered from the forward to the backward pass: ``reshard_after_forward``
  false), ``no_shard`` (every rank holds whole parameters and optimizer state, gradients are
  all-reduced: FSDP2 over a replicate x shard mesh whose shard dimension is 1, as DDP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from policies.weights import DTYPES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("actor.optim.optimizer", "actor.optim.adam_beta1", "actor.optim.adam_beta2",
               "actor.optim.adam_eps", "actor.optim.weight_decay", "actor.fsdp_config.cpu_offload",
               "actor.fsdp_config.offload_pin_memory", "actor.fsdp_config.reshard_after_forward",
               "actor.fsdp_config.sharding_strategy",
               "actor.fsdp_config.mixed_precision.param_dtype",
               "actor.fsdp_config.mixed_precision.reduce_dtype", "actor.fsdp_config.amp_autocast.enabled",
               "actor.fsdp_config.amp_autocast.precision", "actor.fsdp_config.grad_scaler.enabled",
               "actor.fsdp_config.grad_scaler.init_scale", "actor.fsdp_config.grad_scaler.growth_interval")



def build_optimizer(groups: list[dict[str, Any]], optim: Any) -> torch.optim.Optimizer:
    """The optimizer named by ``actor.optim.optimizer`` over these parameter groups."""
    name = optim.optimizer
    if name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, weight_decay=optim.weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return cls(groups, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
               weight_decay=optim.weight_decay)


def fsdp_options(fsdp: Any, mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """Keyword arguments of every ``fully_shard`` call of the actor (``mesh``: ``fsdp_mesh``'s)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy  # FSDP's stack: actors only

    options: dict[str, Any] = {"reshard_after_forward": fsdp.reshard_after_forward
                               and fsdp.sharding_strategy != "shard_grad_op"}
    if mesh is not None:
        options["mesh"] = mesh
    mp = fsdp.mixed_precision
    if (mp.param_dtype, mp.reduce_dtype) != ("fp32", "fp32"):
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[mp.param_dtype],
                                                    reduce_dtype=DTYPES[mp.reduce_dtype])
    if fsdp.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=fsdp.offload_pin_memory)
    return options


def fsdp_mesh(fsdp: Any, device: torch.device) -> DeviceMesh | None:
    """The device mesh of ``no_shard`` (all ranks replicate, none shards), or None: FSDP2's
    default, one dimension over every rank (after ``init_process_group``)."""
    if fsdp.sharding_strategy != "no_shard":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))


def autocast(fsdp: Any, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory for the training forward pass (a no-op unless amp_autocast is on)."""
    amp = fsdp.amp_autocast
    if not amp.enabled:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=DTYPES[amp.precision])


def grad_scaler(fsdp: Any, device: torch.device) -> torch.amp.GradScaler | None:
    scaler = fsdp.grad_scaler
    if not scaler.enabled:
        return None
    return torch.amp.GradScaler(device.type, init_scale=scaler.init_scale,
                                growth_interval=scaler.growth_interval)
