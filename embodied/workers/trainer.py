"""What RL's actor (``actor.py``) and SFT's trainer (``imitation.py``) share: the policy,
distributed by its training backend (``embodied/backends.py``: FSDP2, or Megatron-Core tensor
parallelism; gloo on CPU, NCCL on GPU), its optimizer and learning-rate schedule, one optimizer
step over micro-batches with the skip of non-finite updates, the weights the rollout workers get,
offloading between phases, and checkpoints. A subclass says what it trains on and with what loss."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from embodied.algorithms import POLICY_LOSSES
from embodied.backends import BACKENDS
from embodied.batch import DemoSamples, Samples
from embodied.channel import Channel
from embodied.config.validate import offloaded_parts, training_steps
from embodied.lr_schedule import learning_rate
from embodied.training_options import autocast, build_optimizer
from embodied.worker import Worker
from policies.base import Policy

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("algorithm.loss_type", "actor.seed", "actor.optim.lr", "actor.optim.value_lr", "actor.optim.clip_grad",
               "actor.optim.max_skipped_updates", "actor.model.gradient_checkpointing")


class TrainerWorker(Worker):
    def __init__(self, cfg: DictConfig, channel: Channel):
        self.cfg, self.channel = cfg, channel
        self.algo = cfg.algorithm
        self.torch_device = torch.device("cuda" if self.accelerator == "gpu" else "cpu")
        self.backend = BACKENDS.get(cfg.actor.training_backend)(cfg, self.accelerator)
        torch.manual_seed(cfg.actor.seed)  # identical initial weights on every rank
        policy = self.backend.build(self.torch_device)
        self.reference: torch.nn.Module | None = None  # a frozen copy of the policy, when one is kept
        self.prepare(policy)
        if cfg.actor.model.gradient_checkpointing:
            policy.enable_gradient_checkpointing()
        self.policy = self.backend.wrap(policy)
        self.autocast = autocast(cfg.actor.fsdp_config, self.torch_device)
        self.policy_loss = POLICY_LOSSES.get(self.algo.loss_type)
        optim = cfg.actor.optim
        value = self.policy.value_parameters()
        critic = {id(p) for p in value}
        rest = [p for p in self.policy.parameters() if id(p) not in critic]
        groups = [{"params": rest, "lr": optim.lr}]
        self.lr_ratios = [1.0]  # each group's rate relative to the scheduled one
        if value:
            groups.append({"params": value, "lr": optim.value_lr})
            self.lr_ratios.append(optim.value_lr / optim.lr)
        self.optimizer = self.backend.optimizer(groups, lambda groups: build_optimizer(groups, optim))
        self.scaler = self.backend.loss_scaler(self.optimizer, self.torch_device)
        self.skipped_in_a_row = 0  # optimizer steps skipped for a non-finite loss or gradient

    def prepare(self, policy: Policy) -> None:
        """What the subclass needs of the policy before the backend shards it (a plain module)."""

    def _set_rate(self, step: int) -> float:
        """``actor.lr_sched``'s rate for ``step``, set on every parameter group; returns it."""
        lr = learning_rate(step, self.cfg.actor.lr_sched, training_steps(self.cfg.runner))
        for group, ratio in zip(self.optimizer.param_groups, self.lr_ratios):
            group["lr"] = lr * ratio
        return lr

    def _check_skipped(self, step: int) -> None:
        limit = self.cfg.actor.optim.max_skipped_updates
        if self.skipped_in_a_row >= limit:
            raise FloatingPointError(
                f"{self.skipped_in_a_row} optimizer steps in a row skipped for a non-finite loss or "
                f"gradient (actor.optim.max_skipped_updates={limit}), the last at training step "
                f"{step}; the weights are those of the last good update, as in the last checkpoint")

    def _minibatch(self, batch: Samples | DemoSamples, index: torch.Tensor, micro: int,
                   loss_of: Callable[[Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> dict[str, float]:
        """One optimizer step, accumulating gradients over micro-batches (synced on the last)."""
        self.optimizer.zero_grad(set_to_none=True)
        parts = list(index.split(micro))
        weights = self._weights(batch, parts)
        sums: dict[str, float] = defaultdict(float)
        for i, part in enumerate(parts):
            self.backend.micro_batch(self.policy, last=i == len(parts) - 1)
            loss, metrics = loss_of(batch.map(lambda x: x[part]))
            loss = loss * weights[i] / len(parts)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            for key, value in metrics.items():
                sums[key] += float(value) / len(parts)
        self.backend.reduce_gradients(self.policy)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = self.backend.clip_gradients(self.policy, self.cfg.actor.optim.clip_grad)
        sums["actor/grad_norm"] = norm
        # a non-finite loss or gradient on any rank makes the (global, so same on every rank) norm non-finite
        finite = math.isfinite(norm)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            sums["actor/skipped_updates"] = 1.0
        elif self.scaler:
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        lowered = False  # fp16: an overflow that lowers the loss scale is the scaler's business
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.update()
            lowered = self.scaler.get_scale() < scale
            sums["actor/loss_scale"] = self.scaler.get_scale()
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + (not lowered)
        return sums

    def _weights(self, batch: Samples | DemoSamples, parts: list[torch.Tensor]) -> list[float]:
        """Each micro-batch's factor in the step's loss (before the mean over micro-batches)."""
        return [1.0] * len(parts)

    def get_weights(self) -> dict[str, torch.Tensor] | None:
        """Unsharded weights on rank 0 for the rollout workers (None on other ranks): what
        trains (``Policy.trainable_state_dict``: with LoRA only the adapters and value head)."""
        state = self.policy.trainable_state_dict()
        return state if self.rank == 0 else None

    def probe_logprobs(self, probe: dict[str, Any]) -> torch.Tensor:
        """The current weights' log-probs of a rollout's probe (``Policy.probe_logprobs``): what a
        serving engine must reproduce after the sync. Every rank computes (a collective forward
        under FSDP2)."""
        return self.policy.probe_logprobs(probe["forward_inputs"], probe["actions"])

    def offload(self) -> None:
        """Between phases, what ``offloaded_parts`` names: gradients freed (the next minibatch
        zeroes them anyway), parameters and the reference policy, optimizer moments moved to host
        memory; the CUDA cache emptied. On CPU the moves are no-ops."""
        parts = offloaded_parts(self.cfg, "actor")
        if "grad" in parts:
            self.optimizer.zero_grad(set_to_none=True)
        self._move(torch.device("cpu"), parts)
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        self._move(self.torch_device, offloaded_parts(self.cfg, "actor"))

    def _move(self, device: torch.device, parts: tuple[str, ...]) -> None:
        if "weight" in parts:
            self.policy.to(device)  # FSDP2 re-registers its sharded parameters after a move
            if self.reference is not None:
                self.reference.to(device)
        if "optimizer" in parts:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:  # Adam's scalar step stays put
                        state[key] = value.to(device)
            for main in getattr(self.optimizer, "main_params", ()):  # mixed precision's fp32 weights
                main.data = main.data.to(device)

    def save(self, folder: str) -> None:
        """The policy's weights and the optimizer under ``folder/actor``, as the backend lays
        them out."""
        self.backend.save(self.policy, self.optimizer, Path(folder) / "actor")
        dist.barrier()

    def load(self, folder: str, with_optimizer: bool = True) -> None:
        self.backend.load(self.policy, self.optimizer, Path(folder) / "actor", with_optimizer)



def _mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(keys, (values / dist.get_world_size()).tolist()))
