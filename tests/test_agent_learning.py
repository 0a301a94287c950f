"""The agent learning bar, shortened (benchmarks/agent_learning.py has the full one): a tiny LM
pre-trained mostly to answer products directly, rarely through the calculator, learns with GRPO
over 2-turn episodes to call the tool, and its held-out greedy accuracy rises by 25 points.

Shorter than the benchmark: 300 pre-training steps of 128 traces (the benchmark: 1000 of 64), 8
GRPO steps on one rank per group, 50 held-out rows. Measured on one thread (held-out greedy
accuracy before -> after RL): model seed 0 0.02 -> 0.82, seed 1 0.00 -> 0.78, seed 2 0.02 -> 0.72,
data seed 1 0.00 -> 0.48. The larger batch is what makes it reliable: with 64 traces a step, model
seed 1 had not learnt to copy the calculator's result after 1000 steps (greedy copy 0.00 on
held-out calls), with 128 seeds 0-2 copy 0.66-0.86 by step 300. About 90 CPU-s of pre-training
and 60 in the Ray workers here (the 1000-step version: 150 and 128)."""

from __future__ import annotations

import pytest

from benchmarks.agent_learning import pretrain, train_args, write_problems
from tests.runs import ONE_RANK_EACH, embodied
from tests.test_pipeline import scalars

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
STEPS = 8


def test_a_tiny_lm_learns_to_use_the_calculator(tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # pre-training's floats depend on the thread count; measured with 1: 0.02 -> 0.82
    try:
        write_problems(tmp_path / "data")  # the benchmark's problems and pre-training
        pretrain(tmp_path / "model", tmp_path / "data", tool_share=0.1, steps=300, batch=128)
    finally:
        torch.set_num_threads(threads)
    args = train_args(tmp_path / "model", tmp_path / "data", tmp_path, "agent", steps=STEPS, val_every=STEPS,
                      val_rows=50, extra=["env.train.max_episode_steps=2", "env.eval.max_episode_steps=2",
                                          "actor.micro_batch_size=64", "actor.global_batch_size=256",
                                          *ONE_RANK_EACH])
    result, _ = embodied("train", ["--config-name", "agent_arithmetic_tools_tiny", *args])
    assert result["eval_success_before"] <= 0.1, result  # greedy answers directly, and wrongly
    assert result["eval_success"] >= result["eval_success_before"] + 0.25, result
    tool_time = scalars(tmp_path / "agent", "time/train_tool_s")  # the calculator's share of the env's time
    assert sorted(tool_time) == list(range(1, STEPS + 1)) and sum(tool_time.values()) > 0
