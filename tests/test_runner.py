"""The runner's merging of env workers' episode metrics: overall and per task, across ranks."""

import pytest

from embodied.runner import _merge_ranks, _per_task


def test_ranks_merge_weighted_by_their_episodes_overall_and_per_task():
    rank0 = {"eval/success_once": 0.5, "eval/episodes": 4.0, "eval/env_steps": 40.0,
             "eval/success_once/push": 0.75, "eval/episodes/push": 4.0}
    rank1 = {"eval/success_once": 0.25, "eval/episodes": 4.0, "eval/env_steps": 40.0,
             "eval/success_once/push": 0.0, "eval/episodes/push": 1.0,
             "eval/success_once/pick": 1 / 3, "eval/episodes/pick": 3.0}
    merged = _merge_ranks([rank0, rank1])
    assert merged["eval/success_once"] == pytest.approx(0.375)
    assert merged["eval/episodes"] == 8 and merged["eval/env_steps"] == 80
    assert merged["eval/success_once/push"] == pytest.approx(3 / 5)  # 3 of push's 5 episodes
    assert merged["eval/episodes/push"] == 5
    assert merged["eval/success_once/pick"] == pytest.approx(1 / 3)  # rank 0 ran no pick episode
    assert merged["eval/episodes/pick"] == 3
    assert _per_task(merged) == {"pick": {"success": pytest.approx(1 / 3), "episodes": 3},
                                 "push": {"success": pytest.approx(0.6), "episodes": 5}}


def test_a_rank_without_finished_episodes_does_not_dilute_the_means():
    merged = _merge_ranks([{"train/return": 2.0, "train/episodes": 2.0, "train/env_steps": 10.0},
                           {"train/env_steps": 10.0}])
    assert merged == {"train/return": 2.0, "train/episodes": 2.0, "train/env_steps": 20.0}
