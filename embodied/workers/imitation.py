"""SFT's trainer: the policy trained with an imitation loss (``algorithm.loss_type: sft``) on
minibatches each rank draws from the demonstrations it holds (``embodied/demonstrations.py``); no
rollout reaches it. Everything else (backend, optimizer, checkpoints) is ``TrainerWorker``'s."""

from __future__ import annotations

import time

import torch

from embodied import demonstrations
from embodied.batch import DemoSamples
from embodied.workers.trainer import TrainerWorker, _mean_over_ranks
from policies.base import Policy

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("actor.micro_batch_size", "actor.global_batch_size")


class ImitationWorker(TrainerWorker):
    def prepare(self, policy: Policy) -> None:
        # the demonstrations as the policy stores them, prepared before sharding
        self.demos = demonstrations.load(self.cfg, policy).map(lambda x: x.to(self.torch_device))

    def imitate(self, step: int) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch, drawn from its
        demonstrations (``demonstrations.draw``: seeded by the step), in micro-batches; returns
        metrics averaged over ranks."""
        tic = time.monotonic()
        ranks = self.backend.data_parallel_size
        per_rank = self.cfg.actor.global_batch_size // ranks
        seed = self.cfg.actor.seed + step * 1000 + self.backend.data_parallel_rank
        torch.manual_seed(seed)  # any other draw (dropout) is keyed on the step too, as on resume
        index = demonstrations.draw(self.demos.actions.shape[0], step, per_rank, self.backend.data_parallel_rank,
                                    ranks, self.cfg.actor.seed)
        lr = self._set_rate(step)
        self.policy.train()
        metrics = self._minibatch(self.demos, index, self.cfg.actor.micro_batch_size, self._imitation_loss)
        metrics.setdefault("actor/skipped_updates", 0.0)
        self._check_skipped(step)
        metrics["actor/lr"] = lr
        metrics["time/actor_busy"] = time.monotonic() - tic
        return _mean_over_ranks(metrics)

    def _imitation_loss(self, mb: DemoSamples) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.autocast():
            out = self.policy(mb.forward_inputs, mb.actions, imitation=True)
        return self.policy_loss(*(None if x is None else x.float() for x in (out.logprobs, out.predicted, out.target)))
