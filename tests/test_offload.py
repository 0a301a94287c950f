"""Offload between phases, on real Ray workers on CPU: the rollout worker releases its weights'
memory and gets them back with the next weight sync; the FSDP2 actor frees its gradients and
keeps its optimizer state, or with RLinf's per-part flags (actor.offload_weight / offload_optimizer /
offload_grad) only the parts they name. (The training run with both keys on is in test_pipeline.py.)"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import torch

from embodied.cluster import Cluster
from embodied.config import compose
from embodied.worker import WorkerGroup
from embodied.workers.actor import ActorWorker
from embodied.workers.rollout import RolloutWorker

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

OBS = {"states": np.random.default_rng(0).standard_normal((6, 35)).astype(np.float32)}


class ProbedRollout(RolloutWorker):
    def weights(self) -> dict[str, torch.Tensor]:
        return self.policy.state_dict()

    def memory(self) -> tuple[int, int]:
        """Bytes held by the state dict's tensors, and how many of them are storage-less."""
        tensors = list(self.policy.state_dict().values())
        held = sum(t.untyped_storage().nbytes() for t in tensors if not t.is_meta)
        return held, sum(t.is_meta for t in tensors)

    def act(self) -> list[np.ndarray]:
        with torch.no_grad():
            out = self.policy.act(OBS, do_sample=False)
        return [out.actions.numpy(), out.logprobs.numpy(), out.values.numpy()]


class ProbedActor(ActorWorker):
    def train_once(self) -> float:
        """One optimizer step on a fixed batch (both ranks take part, as FSDP2 needs)."""
        inputs = {"states": torch.as_tensor(OBS["states"])}
        out = self.policy(inputs, torch.zeros(6, 1, 8))
        loss = -out.logprobs.mean() + out.values.pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss)

    def state(self) -> dict:
        moments = [v.full_tensor() for s in self.optimizer.state.values() for k, v in s.items()
                   if k == "exp_avg"]
        return {"grads": sum(p.grad is not None for p in self.policy.parameters()),
                "exp_avg": torch.cat([m.flatten() for m in moments]).numpy(),
                "devices": sorted({str(p.device) for p in self.policy.parameters()})}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(num_nodes=1)
    yield cluster
    cluster.shutdown()


@pytest.mark.slow
def test_rollout_offload_releases_the_weights_and_the_next_sync_restores_them(cluster):
    # bins: the action head's bin values are a non-persistent buffer that no weight sync carries
    cfg = compose("maniskill_ppo_mlp", ["actor.model.action_distribution=bins", "rollout.enable_offload=true"])
    group = WorkerGroup.launch(ProbedRollout, cluster, cluster.plan({"rollout": "0"}), "rollout",
                               args=(cfg, None, 1, 1))
    try:
        (weights,), (before,) = group.execute("weights").wait(), group.execute("act").wait()
        (held, _), = group.execute("memory").wait()
        assert held >= 4 * sum(t.numel() for t in weights.values())

        group.execute("offload").wait()
        group.execute("offload").wait()  # a second offload is a no-op
        assert group.execute("memory").wait() == [(0, len(weights))]
        group.execute("reload").wait()  # full weights only come back with the sync
        group.execute("set_weights", weights, 0).wait()
        assert group.execute("memory").wait() == [(held, 0)]
        for a, b in zip(before, group.execute("act").wait()[0]):
            np.testing.assert_array_equal(a, b)

        # weights that arrive while offloaded act exactly as when loaded into a resident model
        changed = {k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()}
        group.execute("offload").wait()
        group.execute("set_weights", changed, 1).wait()
        after_offload = group.execute("act").wait()[0]
        group.execute("set_weights", changed, 1).wait()  # resident: copied into the tensors
        resident = group.execute("act").wait()[0]
        assert not np.array_equal(after_offload[1], before[1])
        for a, b in zip(after_offload, resident):
            np.testing.assert_array_equal(a, b)
    finally:
        group.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("settings, frees_grads", [
    (["actor.enable_offload=true"], True),
    (["actor.offload_grad=true"], True),  # RLinf's flags, one part each
    (["actor.offload_weight=true", "actor.offload_optimizer=true"], False),
])
def test_actor_offload_frees_gradients_and_keeps_parameters_and_optimizer_state(cluster, settings, frees_grads):
    cfg = compose("maniskill_ppo_mlp", settings)
    group = WorkerGroup.launch(ProbedActor, cluster, cluster.plan({"actor": "all"}), "actor",
                               args=(cfg, None))
    try:
        group.execute("train_once").wait()
        before = group.execute("state").wait()[0]
        weights = group.execute("get_weights").wait()[0]
        assert before["grads"] > 0
        group.execute("offload").wait()
        offloaded = group.execute("state").wait()[0]
        assert (offloaded["grads"] == 0) == frees_grads and offloaded["devices"] == ["cpu"]
        np.testing.assert_array_equal(offloaded["exp_avg"], before["exp_avg"])
        group.execute("reload").wait()
        again = group.execute("get_weights").wait()[0]
        assert all(torch.equal(weights[k], again[k]) for k in weights)
        losses = group.execute("train_once").wait()
        assert np.isfinite(losses).all() and losses[0] == losses[1]
    finally:
        group.shutdown()
