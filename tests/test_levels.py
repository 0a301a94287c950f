"""reward_type / logprob_type plumbing: chunk signals to steps and back, by hand."""

import pytest
import torch

from embodied.algorithms.advantages import compute_gae
from embodied.algorithms.levels import (
    check_levels,
    chunks_to_steps,
    expand_like,
    final_values_to_steps,
    steps_to_chunks,
    values_to_steps,
)

# T = 2 chunk steps, B = 1 env, C = 3 actions per chunk
REWARDS = torch.tensor([[[1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0]]])
DONES = torch.tensor([[[False, False, False]], [[False, False, True]]])


def test_chunk_level_sums_rewards_and_any_dones():
    assert chunks_to_steps(REWARDS, "chunk_level").tolist() == [[6.0], [15.0]]
    assert chunks_to_steps(DONES, "chunk_level", reduce="any").tolist() == [[False], [True]]


def test_action_level_interleaves_slots_into_time():
    assert chunks_to_steps(REWARDS, "action_level").flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert chunks_to_steps(DONES, "action_level").flatten().tolist() == [False] * 5 + [True]


def test_action_level_with_two_envs_keeps_envs_apart():
    rewards = torch.stack([REWARDS[:, 0], 10 * REWARDS[:, 0]], dim=1)  # [2, 2, 3]
    steps = chunks_to_steps(rewards, "action_level")
    assert steps[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert steps[:, 1].tolist() == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    torch.testing.assert_close(steps_to_chunks(steps, 3, "action_level"), rewards)


def test_values_and_final_values_to_steps():
    values = torch.arange(9.0).reshape(3, 1, 3)  # T + 1 = 3 observations, 3 values each
    # 6 action steps + slot 0 of the last observation
    assert values_to_steps(values, "action_level").flatten().tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert final_values_to_steps(torch.tensor([[10.0], [20.0]]), 3, "action_level").flatten().tolist() == [
        0, 0, 10, 0, 0, 20,
    ]
    chunk_values = torch.tensor([[1.0], [2.0], [3.0]])
    assert values_to_steps(chunk_values, "chunk_level") is chunk_values


def test_action_level_gae_by_hand():
    # T = 1 chunk of C = 2 actions: r = [1, 2], values [0.5, 1.0] now and [2.0, 9.0] next chunk.
    # Steps see V = [0.5, 1.0, 2.0] (9.0 is never used), gamma = 0.5, lambda = 1:
    # delta_1 = 2 + 0.5*2.0 - 1.0 = 2      A_1 = 2
    # delta_0 = 1 + 0.5*1.0 - 0.5 = 1      A_0 = 1 + 0.5*2 = 2
    rewards = torch.tensor([[[1.0, 2.0]]])
    values = torch.tensor([[[0.5, 1.0]], [[2.0, 9.0]]])
    none = torch.zeros(1, 1, 2, dtype=torch.bool)
    adv, _ = compute_gae(
        chunks_to_steps(rewards, "action_level"),
        values_to_steps(values, "action_level"),
        chunks_to_steps(none, "action_level"),
        chunks_to_steps(none, "action_level"),
        0.5,
        1.0,
    )
    assert steps_to_chunks(adv, 2, "action_level").tolist() == [[[2.0, 2.0]]]


def test_expand_like_broadcasts_over_token_dims():
    logprobs = torch.zeros(2, 3, 4)
    per_chunk = torch.tensor([1.0, 2.0])
    assert expand_like(per_chunk, logprobs)[1].unique().tolist() == [2.0]
    per_action = torch.arange(6.0).reshape(2, 3)
    assert expand_like(per_action, logprobs)[1, 2].tolist() == [5.0] * 4
    with pytest.raises(ValueError, match="cannot align"):
        expand_like(per_action, torch.zeros(2))


def test_check_levels():
    check_levels("chunk_level", "chunk_level")
    check_levels("action_level", "token_level")
    with pytest.raises(ValueError, match="algorithm.reward_type"):
        check_levels("step_level", "token_level")
    with pytest.raises(ValueError, match="algorithm.logprob_type"):
        check_levels("chunk_level", "seq_level")
    with pytest.raises(ValueError, match="chunk_level needs algorithm.reward_type chunk_level"):
        check_levels("action_level", "chunk_level")
