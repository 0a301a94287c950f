"""Non-finite numbers: NaN or inf in observations or rewards end the run naming the env rank and
chunk step, or are masked and counted with ``env.non_finite=mask`` (end to end:
``env.train.reward_coef=nan`` multiplies every real ManiSkill reward into NaN); a loss whose
gradient overflows float32 (``algorithm.value_loss_coef=1e38``; inf itself is refused by the key's
rule) skips the optimizer step, and ``actor.optim.max_skipped_updates`` skips in a row stop the run
with the last good weights in the checkpoints."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from embodied import checkpoint
from embodied.config import compose
from embodied.workers.env import EnvWorker
from tests.runs import embodied, tiny_config
from tests.test_pipeline import scalars



def _env_worker(non_finite: str) -> EnvWorker:
    """An env worker's checks without its simulators: rank 1 of 2, two stages of 2 envs."""
    worker = EnvWorker.__new__(EnvWorker)
    worker.rank, worker.world_size, worker.stages, worker.masked = 1, 2, 2, {}
    worker.cfg = compose("maniskill_ppo_mlp", ["env.train.total_num_envs=8", "env.eval.total_num_envs=8",
                                               f"env.non_finite={non_finite}"])
    return worker


def test_non_finite_observations_or_rewards_name_env_rank_step_and_envs():
    worker = _env_worker("error")
    obs = {"states": np.zeros((2, 3), np.float32), "task_descriptions": ["a", "b"]}
    rewards = np.array([[0.5], [1.0]], np.float32)
    worker._check_finite("train", 4, 1, obs, rewards)  # all finite: nothing happens
    obs["states"][1, 2] = np.inf
    rewards[0, 0] = np.nan
    # rank 1, stage 1: global envs 6 and 7
    with pytest.raises(FloatingPointError, match=re.escape(
            "env rank 1: non-finite values at train chunk step 4: states of env(s) [7]; rewards of "
            "env(s) [6]; set env.non_finite=mask to zero and count them instead")):
        worker._check_finite("train", 4, 1, obs, rewards)
    with pytest.raises(FloatingPointError, match=r"at eval chunk step 0: states of env\(s\) \[5\]"):
        worker._check_finite("eval", 0, 0, obs, None)  # a reset's observation, stage 0

    worker = _env_worker("mask")
    worker._check_finite("train", 4, 1, obs, rewards)
    assert obs["states"][1, 2] == 0 and rewards[0, 0] == 0 and worker.masked == {"train": 2}


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_masked_rewards_are_counted_and_non_finite_updates_skipped_until_the_limit(tmp_path):
    _, done = embodied("train", tiny_config(tmp_path, env="0", rollout="0", actor="0") + [
        f"runner.output_dir={tmp_path}", "env.train.reward_coef=nan", "env.non_finite=mask",
        "algorithm.value_loss_coef=1e38", "actor.optim.max_skipped_updates=3"], code=1)
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("embodied-train: ActorGroup rank "), line
    assert ("3 optimizer steps in a row skipped for a non-finite loss or gradient "
            "(actor.optim.max_skipped_updates=3), the last at training step 3") in line
    logs = tmp_path / "tiny"
    assert scalars(logs, "train/non_finite") == {1: 20.0, 2: 20.0}  # 2 envs x 10 rewards each step
    assert scalars(logs, "actor/skipped_updates") == {1: 1.0, 2: 1.0}  # one minibatch per step
    assert all(math.isfinite(v) for v in scalars(logs, "critic/value_loss").values())
    ckpts = checkpoint.list_checkpoints(logs / "checkpoints")
    assert [p.name for p in ckpts] == ["global_step_1", "global_step_2"]
    first, second = (torch.load(p / "actor" / "model.pt", weights_only=True) for p in ckpts)
    for key in first:
        assert torch.isfinite(first[key]).all() and torch.equal(first[key], second[key]), key
