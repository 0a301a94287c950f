"""The backends: how the actor distributes, steps and saves its policy (``actor.training_backend``,
each a ``core.backend.TrainingBackend``), and what generates the rollouts (``rollout.backend``).

- ``fsdp``: the model's policy class sharded with FSDP2 (``fully_shard``) over every actor rank,
  data parallel: each rank trains on its own samples, gradients are reduced in the backward pass.
- ``megatron``: Megatron-Core tensor parallelism and data parallelism over the rest
  (``policies/megatron/backend.py``).

Each registry entry declares the keys only it reads (``reads``); the config layer
(``embodied.config``) checks the choices and refuses those keys under the other backend.

Rollouts: ``huggingface`` runs the model's own policy class (``generate`` for the causal LM); a
serving engine (``vllm``, ``sglang``) is the model registry's ``rollout`` class for it, which takes
the same weights (``build_rollout_policy``); the reference's generation-engine keys are read by
the engine that has them with the same meaning (its ``rollout_keys``) and refused otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from core.backend import TrainingBackend
from core.registry import Registry, load
from embodied.config import build_policy
from embodied.training_options import fsdp_mesh, fsdp_options, grad_scaler
from policies import POLICIES
from policies.base import Policy
from policies.megatron import READ as MEGATRON_READS

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("rollout.backend", "rollout.model.precision")

OPTIMIZER_FILE = "optimizer.pt"


class FSDP(TrainingBackend):
    """FSDP2 over all actor ranks. (FSDP's and distributed checkpoint's modules, 0.7 s of imports,
    are imported where they are used: the driver and the rollout workers never shard.)"""

    def __init__(self, cfg: Any, accelerator: str):
        self.cfg = cfg
        dist.init_process_group("nccl" if accelerator == "gpu" else "gloo")
        self.data_parallel_rank, self.data_parallel_size = dist.get_rank(), dist.get_world_size()

    def build(self, device: torch.device) -> Policy:
        return build_policy(self.cfg.actor.model).to(device)

    def wrap(self, policy: Policy) -> Policy:
        """Shard the policy: large models block by block (``shard_units``), then the root."""
        from torch.distributed.fsdp import fully_shard

        fsdp = self.cfg.actor.fsdp_config
        shard = fsdp_options(fsdp, fsdp_mesh(fsdp, next(policy.parameters()).device))
        for unit in policy.shard_units():
            fully_shard(unit, **shard)
        return fully_shard(policy, **shard)

    def loss_scaler(self, optimizer: torch.optim.Optimizer, device: torch.device) -> torch.amp.GradScaler | None:
        return grad_scaler(self.cfg.actor.fsdp_config, device)

    def micro_batch(self, policy: Policy, last: bool) -> None:
        """Gradients are reduced across ranks in the last micro-batch's backward only."""
        policy.set_requires_gradient_sync(last)

    def reduce_gradients(self, policy: Policy) -> None:
        """Nothing left to do: the last backward reduced them."""

    def clip_gradients(self, policy: Policy, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def save(self, policy: Policy, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """The policy's own layout (every rank gathers, rank 0 writes) and the optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        policy.save_checkpoint(path)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(policy, optimizer, options=full)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            torch.save(optim, path / OPTIMIZER_FILE)

    def load(self, policy: Policy, optimizer: torch.optim.Optimizer, path: Path, with_optimizer: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # the policy checked the names and shapes; a LoRA checkpoint holds only what trains
        state = policy.read_checkpoint(path)
        set_model_state_dict(policy, state, options=StateDictOptions(full_state_dict=True, strict=False))
        if with_optimizer:
            optim = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=False)
            # a parameter that never had a gradient has no state in the run being resumed either
            # (OpenVLA's featurizer reads the ViT's second-to-last block: the last block's
            # parameters train in a full fine-tune but get none), so it gets none here: not strict
            set_optimizer_state_dict(policy, optimizer, optim, options=StateDictOptions(full_state_dict=True, strict=False))


BACKENDS = Registry("training backend", "actor.training_backend")
BACKENDS.add("fsdp", FSDP, reads={"actor.fsdp_config": "FSDP2's sharding, precision and offload options"})
BACKENDS.add("megatron", "policies.megatron.backend:MegatronBackend", reads=MEGATRON_READS)


def rollout_options(cfg: Any) -> dict[str, Any]:
    """The ``actor.model`` options a rollout worker builds its policy from."""
    options = OmegaConf.to_container(cfg.actor.model, resolve=True)
    if cfg.rollout.model.get("precision") is not None:
        options["precision"] = cfg.rollout.model.precision
    return options


def build_rollout_policy(cfg: Any, cpu_threads: int | None = None) -> Policy:
    """What a rollout worker acts with: the model's policy (``rollout.backend: huggingface``), or
    the serving engine the model registry names for the backend, started on the same weights
    (``cpu_threads``: the worker's CPU slots, on a machine without GPUs), in
    ``rollout.model.precision`` where it is set (the synced weights are cast to it)."""
    backend = cfg.rollout.backend
    options = rollout_options(cfg)
    if backend == "huggingface":
        return build_policy(options)
    from embodied.config import schema

    schema.check(options, "actor.model.", options["model_type"])
    engine = load(POLICIES.declared(options["model_type"])["rollout"][backend])
    return engine(options, OmegaConf.to_container(cfg.rollout, resolve=True), cpu_threads=cpu_threads)
