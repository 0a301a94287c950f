"""Actor: the policy, distributed by its training backend (``embodied/backends.py``: FSDP2, or
Megatron-Core tensor parallelism; gloo on CPU, NCCL on GPU), trained with PPO or GRPO on the
trajectories the rollout workers send through the replay channel, or with SFT (an imitation
loss, ``update`` -> ``imitate``) on minibatches each rank draws from the demonstrations it holds.

With ``rollout.recompute_logprobs`` the old log-probs of the ratio are recomputed here, by the
weights that generated the rollout (the actor's, synced before it), instead of taken from the
rollout engine. The KL reference (``algorithm.kl_beta > 0``) is the policy's own frozen
reference (a LoRA policy's base, adapters off) or else a frozen copy of the initial policy."""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from embodied.algorithms import POLICY_LOSSES, actor_critic_loss, loss_hyperparameters, reduce_logprobs, value_loss
from embodied.algorithms.trajectory import normalize, training_samples
from embodied.backends import BACKENDS
from embodied import demonstrations
from embodied.batch import DemoSamples, Samples, Trajectory
from embodied.channel import Channel
from embodied.channel.keys import replay_key
from embodied.config import training_steps
from embodied.lr_schedule import learning_rate
from embodied.training_options import autocast, build_optimizer, grad_scaler
from embodied.worker import Worker

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("algorithm.loss_type", "algorithm.kl_beta", "algorithm.entropy_bonus",
               "algorithm.calculate_entropy", "algorithm.use_kl_in_reward", "algorithm.target_kl",
               "algorithm.logprob_type", "algorithm.entropy_type", "algorithm.update_epochs",
               "algorithm.shuffle_rollout", "algorithm.logprob_forward_micro_batch_size", "algorithm.critic_warmup",
               "rollout.recompute_logprobs",
               "actor.micro_batch_size", "actor.global_batch_size", "actor.seed", "actor.optim.lr",
               "actor.optim.value_lr", "actor.optim.clip_grad", "actor.optim.max_skipped_updates",
               "actor.model.gradient_checkpointing")


class ActorWorker(Worker):
    def __init__(self, cfg: DictConfig, channel: Channel):
        self.cfg, self.channel = cfg, channel
        self.algo = cfg.algorithm
        self.torch_device = torch.device("cuda" if self.accelerator == "gpu" else "cpu")
        self.backend = BACKENDS.get(cfg.actor.training_backend)(cfg, self.accelerator)
        torch.manual_seed(cfg.actor.seed)  # identical initial weights on every rank
        policy = self.backend.build(self.torch_device)
        self.imitation = POLICY_LOSSES.declared(self.algo.loss_type)["imitation"]
        # the demonstrations as the policy stores them, prepared before sharding (a plain module)
        self.demos = demonstrations.load(cfg, policy).map(lambda x: x.to(self.torch_device)) if self.imitation else None
        self.reference = None  # a frozen copy, when the policy has no reference of its own
        if self.algo.kl_beta > 0 and policy.frozen_reference() is None:
            self.reference = copy.deepcopy(policy).requires_grad_(False)
        if cfg.actor.model.gradient_checkpointing:
            policy.enable_gradient_checkpointing()
        self.policy = self.backend.wrap(policy)
        self.autocast = autocast(cfg.actor.fsdp_config, self.torch_device)
        self.scaler = grad_scaler(cfg.actor.fsdp_config, self.torch_device)
        self.policy_loss = POLICY_LOSSES.get(self.algo.loss_type)
        self.proximal = POLICY_LOSSES.declared(self.algo.loss_type)["proximal"]
        optim = cfg.actor.optim
        value = self.policy.value_parameters()
        critic = {id(p) for p in value}
        rest = [p for p in self.policy.parameters() if id(p) not in critic]
        groups = [{"params": rest, "lr": optim.lr}]
        self.lr_ratios = [1.0]  # each group's rate relative to the scheduled one
        if value:
            groups.append({"params": value, "lr": optim.value_lr})
            self.lr_ratios.append(optim.value_lr / optim.lr)
        self.optimizer = build_optimizer(groups, optim)
        self.skipped_in_a_row = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.loss_args = loss_hyperparameters(self.algo)
        if self.algo.use_kl_in_reward:
            self.loss_args["kl_beta"] = 0.0  # the KL is already in the rewards

    def update(self, step: int, num_pieces: int) -> dict[str, float]:
        """Take this rank's ``num_pieces`` trajectory pieces from the replay channel, compute
        advantages, run ``update_epochs`` passes of minibatch updates; returns metrics averaged
        over ranks."""
        tic = time.monotonic()
        queue = replay_key(self.cfg, self.rank)
        pieces = [self.channel.get(queue) for _ in range(num_pieces)]
        waited = time.monotonic() - tic  # for the rollout: what bounds the step when it is long
        # pieces of several rollout ranks arrive in any order: a stable sort by source fixes the
        # batch's order (each source's rollout epochs arrive, and stay, in order)
        pieces.sort(key=lambda piece: piece["source"])
        # how many updates behind this step's (step - 1 applied) the acting weights were
        lag = float(max(step - 1 - int(piece["trajectory"].versions.min()) for piece in pieces))
        batch = Samples.cat([self._samples(piece["trajectory"]) for piece in pieces], dim=0)
        batch = normalize(batch, self.algo, dist.all_reduce)
        count = batch.advantages.shape[0]
        per_rank = self.cfg.actor.global_batch_size // self.backend.data_parallel_size
        micro = self.cfg.actor.micro_batch_size
        # (the ranks of a tensor-parallel group hold the same samples and draw the same minibatches)
        seed = self.cfg.actor.seed + step * 1000 + self.backend.data_parallel_rank
        generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # any other draw (dropout) is keyed on the step too, as on resume
        sums: dict[str, float] = defaultdict(float)
        updates, planned = 0, self.algo.update_epochs * (count // per_rank)
        lr = learning_rate(step, self.cfg.actor.lr_sched, training_steps(self.cfg.runner))
        for group, ratio in zip(self.optimizer.param_groups, self.lr_ratios):
            group["lr"] = lr * ratio
        # a fresh critic first learns the returns; its advantages would move the policy at random
        loss_of = self._loss
        if step <= self.algo.critic_warmup:
            loss_of = self._critic_loss
            self.optimizer.param_groups[0]["lr"] = 0.0  # the policy's group (the critic's is the second)
        self.policy.train()
        for index in _minibatches(count, per_rank, self.algo.update_epochs, generator, self.algo.shuffle_rollout):
            metrics = self._minibatch(batch, index, micro, loss_of)
            for key, value in metrics.items():
                sums[key] += value
            updates += 1
            if self._kl_exceeded(metrics.get("actor/approx_kl", 0.0)):
                break
        skipped = sums.pop("actor/skipped_updates", 0.0)
        self._check_skipped(step)
        metrics = {k: v / max(updates, 1) for k, v in sums.items()}
        metrics["actor/skipped_updates"] = skipped
        metrics["actor/lr"] = lr
        metrics["actor/update_fraction"] = updates / max(planned, 1)
        metrics["actor/version_lag"] = lag
        metrics["time/actor_wait"] = waited
        metrics["time/actor_busy"] = time.monotonic() - tic - waited
        return _mean_over_ranks(metrics)

    def imitate(self, step: int) -> dict[str, float]:
        """SFT's training step: one optimizer step on this rank's share of the global batch,
        drawn from its demonstrations (``demonstrations.draw``: seeded by the step), in
        micro-batches; returns metrics averaged over ranks."""
        tic = time.monotonic()
        ranks = self.backend.data_parallel_size
        per_rank = self.cfg.actor.global_batch_size // ranks
        seed = self.cfg.actor.seed + step * 1000 + self.backend.data_parallel_rank
        torch.manual_seed(seed)  # any other draw (dropout) is keyed on the step too, as on resume
        index = demonstrations.draw(self.demos.actions.shape[0], step, per_rank, self.backend.data_parallel_rank,
                                    ranks, self.cfg.actor.seed)
        lr = learning_rate(step, self.cfg.actor.lr_sched, training_steps(self.cfg.runner))
        for group, ratio in zip(self.optimizer.param_groups, self.lr_ratios):
            group["lr"] = lr * ratio
        self.policy.train()
        metrics = self._minibatch(self.demos, index, self.cfg.actor.micro_batch_size, self._imitation_loss)
        metrics.setdefault("actor/skipped_updates", 0.0)
        self._check_skipped(step)
        metrics["actor/lr"] = lr
        metrics["time/actor_busy"] = time.monotonic() - tic
        return _mean_over_ranks(metrics)

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
        sums: dict[str, float] = defaultdict(float)
        for i, part in enumerate(parts):
            self.backend.micro_batch(self.policy, last=i == len(parts) - 1)
            loss, metrics = loss_of(batch.map(lambda x: x[part]))
            loss = loss / len(parts)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            for key, value in metrics.items():
                sums[key] += float(value) / len(parts)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        self.backend.reduce_gradients(self.policy)
        norm = self.backend.clip_gradients(self.policy, self.cfg.actor.optim.clip_grad)
        sums["actor/grad_norm"] = norm
        if self.scaler:  # fp16: the scaler skips steps with inf gradients and lowers its scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        # a non-finite loss on any rank makes the (global, so same on every rank) norm non-finite
        elif math.isfinite(norm):
            self.optimizer.step()
            self.skipped_in_a_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_in_a_row += 1
            sums["actor/skipped_updates"] = 1.0
        return sums

    def _kl_exceeded(self, approx_kl: float) -> bool:
        """``algorithm.target_kl``: every rank stops at the same minibatch (mean KL over ranks)."""
        if self.algo.target_kl is None:
            return False
        kl = torch.tensor([approx_kl], dtype=torch.float64)
        dist.all_reduce(kl)
        return kl.item() / self.world_size > self.algo.target_kl

    def _samples(self, traj: Trajectory) -> Samples:
        # channel payloads are views of shared memory: copy into tensors the actor owns
        traj = traj.map(lambda x: torch.as_tensor(x).to(self.torch_device, copy=True))
        if self.cfg.rollout.recompute_logprobs:
            traj.logprobs = self._logprobs(self.policy, traj)
        ref = None
        if self.algo.kl_beta > 0:
            if self.reference is not None:
                ref = self._logprobs(self.reference, traj)
            else:
                with self.policy.frozen_reference():
                    ref = self._logprobs(self.policy, traj)
        # a decoupled loss anchors on the policy as it is now, before this step's updates
        proximal = self._logprobs(self.policy, traj, with_values=True) if self.proximal else None
        return training_samples(traj, self.algo, ref, proximal)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, traj: Trajectory, with_values: bool = False) -> Any:
        """Per-token log-probs of the trajectory's actions under ``model`` (and, with
        ``with_values``, its values per sample or None), in forward passes of
        ``algorithm.logprob_forward_micro_batch_size`` samples."""
        steps, envs = traj.actions.shape[:2]
        flat = {k: v.flatten(0, 1) for k, v in traj.forward_inputs.items()}
        actions = traj.actions.flatten(0, 1)
        size = self.algo.logprob_forward_micro_batch_size
        model.eval()
        outs = [model({k: v[i:i + size] for k, v in flat.items()}, actions[i:i + size])
                for i in range(0, actions.shape[0], size)]
        logprobs = torch.cat([o.logprobs for o in outs])
        logprobs = logprobs.reshape(steps, envs, *logprobs.shape[1:])
        if not with_values:
            return logprobs
        return logprobs, None if outs[0].values is None else torch.cat([o.values.float() for o in outs])

    def _loss(self, mb: Samples) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.autocast():
            out = self.policy(mb.forward_inputs, mb.actions)
        level = self.algo.logprob_type
        entropy = None
        if self.algo.entropy_bonus > 0 or self.algo.calculate_entropy:
            entropy = reduce_logprobs(out.entropy.float(), self.algo.entropy_type)
        return actor_critic_loss(
            logprobs=reduce_logprobs(out.logprobs.float(), level), old_logprobs=mb.old_logprobs,
            advantages=mb.advantages, mask=mb.mask, token_mask=mb.token_mask, entropy=entropy,
            values=out.values.float() if mb.returns is not None else None, old_values=mb.old_values,
            returns=mb.returns, ref_logprobs=mb.ref_logprobs, policy_loss=self.policy_loss,
            proximal_logprobs=mb.proximal_logprobs, **self.loss_args,
        )

    def _critic_loss(self, mb: Samples) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``algorithm.critic_warmup``'s loss: the value loss alone."""
        with self.autocast():
            out = self.policy(mb.forward_inputs, mb.actions)
        loss, metrics = value_loss(out.values.float(), mb.old_values, mb.returns, mb.mask,
                                   value_clip=self.loss_args["value_clip"], huber_delta=self.loss_args["huber_delta"])
        return self.loss_args["value_loss_coef"] * loss, metrics

    def _imitation_loss(self, mb: DemoSamples) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.autocast():
            out = self.policy(mb.forward_inputs, mb.actions, imitation=True)
        return self.policy_loss(*(None if x is None else x.float() for x in (out.logprobs, out.predicted, out.target)))

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
        """Between phases: gradients freed (the next minibatch zeroes them anyway), parameters,
        optimizer moments and the reference policy moved to host memory, the CUDA cache emptied.
        On CPU the moves are no-ops."""
        self.optimizer.zero_grad(set_to_none=True)
        self._move(torch.device("cpu"))
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        self._move(self.torch_device)

    def _move(self, device: torch.device) -> None:
        self.policy.to(device)  # FSDP2 re-registers its sharded parameters after a move
        if self.reference is not None:
            self.reference.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:  # Adam's scalar step stays put
                    state[key] = value.to(device)

    def save(self, folder: str) -> None:
        """The policy's weights and the optimizer under ``folder/actor``, as the backend lays
        them out."""
        self.backend.save(self.policy, self.optimizer, Path(folder) / "actor")
        dist.barrier()

    def load(self, folder: str, with_optimizer: bool = True) -> None:
        self.backend.load(self.policy, self.optimizer, Path(folder) / "actor", with_optimizer)


def _minibatches(count: int, size: int, epochs: int, generator: torch.Generator, shuffle: bool = True):
    """Sample indices of each minibatch: ``epochs`` passes (shuffled, or in the rollout's order),
    a partial last one dropped."""
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator) if shuffle else torch.arange(count)
        for start in range(0, count - size + 1, size):
            yield order[start:start + size]


def _mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(keys, (values / dist.get_world_size()).tolist()))
