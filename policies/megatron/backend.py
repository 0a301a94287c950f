"""``actor.training_backend: megatron``: the model's Megatron-Core class (the model registry's
``training`` declaration), tensor parallel over ``actor.model.tensor_model_parallel_size``
consecutive ranks and data parallel over the rest, with a plain torch optimizer: the ranks of a
tensor-parallel group train on the same samples, gradients are averaged over the data-parallel
replicas after the last backward and clipped counting each shard once (``training.py``). With
``actor.optim.fp16`` / ``bf16`` the optimizer steps fp32 main weights (``mixed_precision.py``), with
``use_distributed_optimizer`` each replica steps its share (``distributed_optimizer.py``)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core.backend import TrainingBackend
from core.errors import ConfigError
from core.registry import load
from policies import POLICIES
from policies.megatron.distributed_optimizer import ShardedOptimizer
from policies.megatron.mixed_precision import INITIAL_SCALE, LossScale, MainWeightsOptimizer, Scaler
from policies.megatron.options import check_options
from policies.megatron.policy import MegatronCausalLMPolicy

CHECKPOINT_DIR = "megatron"  # the reshardable checkpoint, beside model.pt (for eval and export)


class MegatronBackend(TrainingBackend):
    def __init__(self, cfg: Any, accelerator: str) -> None:
        self.cfg = cfg
        self.mixed: MainWeightsOptimizer | None = None  # the optimizer of fp32 main weights, if any
        backend = cfg.actor.megatron.distributed_backend if accelerator == "gpu" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=cfg.actor.megatron.distributed_timeout_minutes))

    def build(self, device: torch.device) -> MegatronCausalLMPolicy:
        """The model's Megatron class, from the plain options (it sets up the process groups)."""
        from omegaconf import OmegaConf

        from policies.megatron import training

        options = OmegaConf.to_container(self.cfg.actor.model, resolve=True)
        policy = load(POLICIES.declared(options["model_type"])["training"]["megatron"])(options)
        self.data_parallel_rank, self.data_parallel_size = training.data_parallel_rank(), training.data_parallel_size()
        return policy.to(device)

    def wrap(self, policy: MegatronCausalLMPolicy) -> MegatronCausalLMPolicy:
        return policy

    def optimizer(self, groups: list[dict[str, Any]],
                  build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> Any:
        """``build``'s optimizer; with ``actor.optim.fp16`` / ``bf16`` over fp32 main weights
        (``mixed_precision.py``), with ``use_distributed_optimizer`` over this data-parallel
        replica's share of the parameters (``distributed_optimizer.py``)."""
        from megatron.core import parallel_state

        optim = self.cfg.actor.optim
        scale = None
        if optim.bf16:
            scale = LossScale(1.0, optim.loss_scale_window, dynamic=False)
        elif optim.fp16 and optim.loss_scale is not None:
            scale = LossScale(optim.loss_scale, optim.loss_scale_window, dynamic=False)
        elif optim.fp16:
            scale = LossScale(INITIAL_SCALE, optim.loss_scale_window, dynamic=True)

        def make(groups: list[dict[str, Any]]) -> Any:
            if scale is None:
                return build(groups)
            self.mixed = MainWeightsOptimizer(groups, build, scale)
            return self.mixed

        self.sharded = optim.use_distributed_optimizer and self.data_parallel_size > 1
        optimizer = (ShardedOptimizer(groups, make, parallel_state.get_data_parallel_group()) if self.sharded
                     else make(groups))
        self.stepped = [p for group in optimizer.param_groups for p in group["params"]]  # what the clip sees
        return optimizer

    def loss_scaler(self, optimizer: Any, device: torch.device) -> Scaler | None:
        return Scaler(self.mixed) if self.mixed else None

    def micro_batch(self, policy: MegatronCausalLMPolicy, last: bool) -> None:
        """Nothing per micro-batch: the gradients are reduced once, in ``reduce_gradients``."""

    def reduce_gradients(self, policy: MegatronCausalLMPolicy) -> None:
        policy.reduce_gradients()

    def clip_gradients(self, policy: MegatronCausalLMPolicy, max_norm: float) -> float:
        return policy.clip_grad_norm(max_norm, self.stepped, self.sharded)

    def save(self, policy: MegatronCausalLMPolicy, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """A ``dist_checkpointing`` folder of the weights and the optimizer (loadable at any tensor-
        parallel size), and the full weights in the rollout policy's layout (``model.pt``), which
        ``embodied-eval`` and ``embodied-export`` read."""
        policy.save_checkpoint(path / CHECKPOINT_DIR, optimizer)
        state = policy.trainable_state_dict()
        if dist.get_rank() == 0:
            torch.save(state, path / "model.pt")

    def load(self, policy: MegatronCausalLMPolicy, optimizer: torch.optim.Optimizer, path: Path,
             with_optimizer: bool) -> None:
        folder = path / CHECKPOINT_DIR
        if not folder.is_dir():
            raise ConfigError(f"{path} holds no {CHECKPOINT_DIR}/ folder: it was not written with "
                              "actor.training_backend megatron")
        policy.load_state_dict(policy.read_checkpoint(folder))
        if with_optimizer:
            policy.load_optimizer(optimizer, folder)  # with the main weights, if any
        elif self.mixed:
            self.mixed.copy_from_model()

    @classmethod
    def check(cls, cfg: Any, actor_ranks: int) -> None:
        """The Megatron options fit the checkpoint and the ranks."""
        from omegaconf import OmegaConf

        check_options(OmegaConf.to_container(cfg.actor.model, resolve=True), actor_ranks)

    @classmethod
    def refused(cls, cfg: Any) -> dict[str, str]:
        return {"actor.model.is_lora": "actor.training_backend megatron has no LoRA (Megatron-Core has none for "
                                       "its tensor-parallel layers, and peft wraps torch Linear layers); train "
                                       "LoRA with actor.training_backend fsdp",
                "actor.model.add_value_head": "actor.training_backend megatron trains no value head (its GPT model "
                                              "has none here); PPO's critic trains with actor.training_backend fsdp"}
