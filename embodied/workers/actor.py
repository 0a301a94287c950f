"""RL's actor: PPO or GRPO updates of the policy (``TrainerWorker``: the backend, optimizer and
checkpoints) on the trajectories the rollout workers send through the replay channel.

With ``rollout.recompute_logprobs`` the old log-probs of the ratio are recomputed here, by the
weights that generated the rollout (the actor's, synced before it), instead of taken from the
rollout engine. The KL reference (``algorithm.kl_beta > 0``) is the policy's own frozen
reference (a LoRA policy's base, adapters off) or else a frozen copy of the initial policy."""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from embodied.algorithms import (
    POLICY_LOSSES,
    actor_critic_loss,
    expand_like,
    loss_hyperparameters,
    reduce_logprobs,
    valid_mask,
    valid_token_weights,
    value_loss,
)
from embodied.algorithms.trajectory import is_weight_metrics, normalize, training_samples, truncated_is_weights
from embodied.batch import Samples, Trajectory
from embodied.channel import Channel
from embodied.channel.keys import replay_key
from embodied.workers.trainer import TrainerWorker, _mean_over_ranks
from policies.base import Policy

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("algorithm.kl_beta", "algorithm.entropy_bonus",
               "algorithm.calculate_entropy", "algorithm.use_kl_in_reward", "algorithm.target_kl",
               "algorithm.logprob_type", "algorithm.entropy_type", "algorithm.update_epochs",
               "algorithm.shuffle_rollout", "algorithm.logprob_forward_micro_batch_size", "algorithm.critic_warmup",
               "rollout.recompute_logprobs", "actor.micro_batch_size", "actor.global_batch_size",
               "algorithm.importance_sampling_fix", "algorithm.importance_sampling_clip")


class ActorWorker(TrainerWorker):
    def __init__(self, cfg: DictConfig, channel: Channel):
        super().__init__(cfg, channel)
        self.proximal = POLICY_LOSSES.declared(self.algo.loss_type)["proximal"]
        self.loss_args = loss_hyperparameters(self.algo)
        if self.algo.use_kl_in_reward:
            self.loss_args["kl_beta"] = 0.0  # the KL is already in the rewards

    def prepare(self, policy: Policy) -> None:
        if self.algo.kl_beta > 0 and policy.frozen_reference() is None:
            self.reference = copy.deepcopy(policy).requires_grad_(False)

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
        lr = self._set_rate(step)
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
        if batch.is_weights is not None:
            metrics.update(is_weight_metrics(batch, self.algo.importance_sampling_clip))
        metrics["time/actor_wait"] = waited
        metrics["time/actor_busy"] = time.monotonic() - tic - waited
        return _mean_over_ranks(metrics)

    def _weights(self, batch: Samples, parts: list[torch.Tensor]) -> list[float]:
        """``algorithm.use_valid_token_scale``: micro-batches weighed by their valid tokens, so that
        the step's loss is the token mean over the whole minibatch on every data-parallel rank."""
        if not self.algo.use_valid_token_scale:
            return super()._weights(batch, parts)
        tokens = torch.stack([valid_mask(batch.mask[p], batch.token_mask[p], batch.old_logprobs[p]).sum()
                              for p in parts]).double().cpu()
        total = tokens.sum()
        dist.all_reduce(total)  # over every rank: the ranks of a tensor-parallel group count theirs alike
        replicas = self.backend.data_parallel_size
        return valid_token_weights(tokens, total * replicas / self.world_size, replicas).tolist()

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
        rollout_logprobs = traj.logprobs
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
        samples = training_samples(traj, self.algo, ref, proximal)
        if self.algo.importance_sampling_fix:  # validated: traj.logprobs are the actor's, recomputed
            samples.is_weights = truncated_is_weights(traj.logprobs, rollout_logprobs, self.algo.logprob_type,
                                                      self.algo.importance_sampling_clip)
        return samples

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
        advantages = mb.advantages
        if mb.is_weights is not None:
            advantages = expand_like(advantages, mb.is_weights) * mb.is_weights
        return actor_critic_loss(
            logprobs=reduce_logprobs(out.logprobs.float(), level), old_logprobs=mb.old_logprobs,
            advantages=advantages, mask=mb.mask, token_mask=mb.token_mask, entropy=entropy,
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


def _minibatches(count: int, size: int, epochs: int, generator: torch.Generator, shuffle: bool = True):
    """Sample indices of each minibatch: ``epochs`` passes (shuffled, or in the rollout's order),
    a partial last one dropped."""
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator) if shuffle else torch.arange(count)
        for start in range(0, count - size + 1, size):
            yield order[start:start + size]
