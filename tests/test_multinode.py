"""A real Ray cluster of two nodes on this machine (two raylets, as Ray's own tests make them):
env workers on one node, rollout and actor on the other, observations and actions crossing
nodes through the channel, rollouts overlapping updates (``staleness_threshold=1``). Training
equals the single-node run's step for step; losing the env node ends the run within 30 s naming
group, rank and node; a new node lets the run resume."""

from __future__ import annotations

import json
import time

import pytest
import torch
from ray.cluster_utils import Cluster as RayTestCluster

from embodied import checkpoint
from tests.runs import Run, tiny_config
from tests.test_pipeline import scalars

pytestmark = pytest.mark.slow
STEPS = 3
ASYNC = ["algorithm.staleness_threshold=1", "algorithm.loss_type=decoupled_actor_critic"]


def test_two_node_run_equals_one_node_run_and_survives_losing_a_node(tmp_path, ray_session):
    # the single-node run, in a process of its own on the session's one-node cluster, beside the two-node one
    single = Run(tiny_config(tmp_path / "c1") + [f"runner.output_dir={tmp_path / 'single'}",
                                                 f"runner.max_epochs={STEPS}", *ASYNC], tmp_path, "single",
                 ray_address=ray_session)
    ray_cluster = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        lost = ray_cluster.add_node(num_cpus=2)
        ray_cluster.wait_for_nodes()
        # node 0 is the driver's (Ray connects a driver to the head); global ranks 2-3 are node 1
        args = tiny_config(tmp_path / "c2", env="2", rollout="0", actor="0-1") + [
            f"runner.output_dir={tmp_path / 'multi'}", f"cluster.ray_address={ray_cluster.address}",
            "cluster.num_nodes=2", "runner.resume_dir=auto", *ASYNC]
        ckpts = tmp_path / "multi" / "tiny" / "checkpoints"
        run = Run(args, tmp_path, "multi")
        run.wait_for(lambda: (c := checkpoint.latest(ckpts)) is not None
                     and checkpoint.read_trainer_state(c)["step"] >= STEPS)
        assert run.pids("EnvGroup")[0][1] == 1 and {n for _, n in run.pids("RolloutGroup")} == {0}
        ray_cluster.remove_node(lost, allow_graceful=False)
        gone = time.monotonic()
        code, _ = run.finish(timeout=60)
        assert time.monotonic() - gone < 30 and code == 1
        assert run.last_error_line().startswith("embodied-train: EnvGroup rank 0 on node 1 (")
        last = checkpoint.latest(ckpts)
        torch.load(last / "actor" / "model.pt", weights_only=True)

        code, err = single.finish(timeout=240)
        assert code == 0, err[-3000:]
        # the first steps, across nodes, are the single-node run's exactly; from step 2 on the
        # rollout ran with the weights of one update before the actor's
        assert scalars(tmp_path / "single" / "tiny", "actor/version_lag") == {1: 0.0, 2: 1.0, 3: 1.0}
        for tag in ("train/return", "actor/policy_loss", "critic/value_loss", "actor/approx_kl",
                    "actor/grad_norm", "actor/behave_weight"):
            one = scalars(tmp_path / "single" / "tiny", tag)
            two = {k: v for k, v in scalars(tmp_path / "multi" / "tiny", tag).items() if k <= STEPS}
            assert sorted(one) == list(range(1, STEPS + 1)) and two == one, tag

        ray_cluster.add_node(num_cpus=2)  # a replacement for the lost node
        ray_cluster.wait_for_nodes()
        step = checkpoint.read_trainer_state(last)["step"]
        resumed = Run(args + [f"runner.max_epochs={step + 1}"], tmp_path, "resumed")
        code, err = resumed.finish(timeout=240)
        assert code == 0, err[-3000:]
        assert f"at step {step}" in resumed.stdout.read_text()
        assert json.loads(resumed.stdout.read_text().splitlines()[-1])["env_steps"] == (step + 1) * 20
    finally:
        ray_cluster.shutdown()
        if single.proc.poll() is None:  # the test failed before the single-node run finished
            single.proc.kill()
