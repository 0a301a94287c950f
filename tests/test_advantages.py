"""GAE and GRPO advantages against values derived by hand in the comments."""

import math

import pytest
import torch

from embodied.algorithms.advantages import (
    compute_gae,
    episode_returns,
    first_episode_mask,
    grpo_advantages,
    nonuniform_group_mask,
    normalize_advantages,
)

GAMMA, LAM = 0.9, 0.8  # gamma * lambda = 0.72

# One env, 3 steps: r = [1, 0, 2], V(s_0..s_3) = [0.5, 1.0, 1.5, 2.0].
REWARDS = torch.tensor([[1.0], [0.0], [2.0]])
VALUES = torch.tensor([[0.5], [1.0], [1.5], [2.0]])
NO = torch.zeros(3, 1, dtype=torch.bool)
AT_STEP_1 = torch.tensor([[False], [True], [False]])


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected).reshape(actual.shape), rtol=0, atol=1e-5)


def test_gae_without_episode_end():
    # delta_2 = 2 + 0.9*2.0 - 1.5 = 2.3          A_2 = 2.3
    # delta_1 = 0 + 0.9*1.5 - 1.0 = 0.35         A_1 = 0.35 + 0.72*2.3   = 2.006
    # delta_0 = 1 + 0.9*1.0 - 0.5 = 1.4          A_0 = 1.4  + 0.72*2.006 = 2.84432
    adv, ret = compute_gae(REWARDS, VALUES, NO, NO, GAMMA, LAM)
    _close(adv, [2.84432, 2.006, 2.3])
    _close(ret, [2.84432 + 0.5, 2.006 + 1.0, 2.3 + 1.5])


def test_gae_termination_does_not_bootstrap():
    # step 1 terminates: delta_1 = 0 + 0 - 1.0 = -1, nothing flows back from step 2.
    # A_2 = 2.3 (a new episode), A_1 = -1.0, A_0 = 1.4 + 0.72*(-1.0) = 0.68
    adv, _ = compute_gae(REWARDS, VALUES, AT_STEP_1, NO, GAMMA, LAM)
    _close(adv, [0.68, -1.0, 2.3])


def test_gae_truncation_bootstraps_from_final_observation():
    # step 1 truncated, V(final obs) = 3.0: delta_1 = 0 + 0.9*3.0 - 1.0 = 1.7, A_1 = 1.7 (no carry
    # from the next episode), A_0 = 1.4 + 0.72*1.7 = 2.624
    final_values = torch.tensor([[0.0], [3.0], [0.0]])
    adv, ret = compute_gae(REWARDS, VALUES, NO, AT_STEP_1, GAMMA, LAM, final_values=final_values)
    _close(adv, [2.624, 1.7, 2.3])
    _close(ret, [3.124, 2.7, 3.8])


def test_gae_truncation_without_final_values_uses_next_observation():
    # no auto-reset: the next observation is the final one, V = 1.5: delta_1 = 0.35, A_1 = 0.35,
    # A_0 = 1.4 + 0.72*0.35 = 1.652
    adv, _ = compute_gae(REWARDS, VALUES, NO, AT_STEP_1, GAMMA, LAM)
    _close(adv, [1.652, 0.35, 2.3])


def test_gae_terminated_and_truncated_counts_as_terminated():
    final_values = torch.full((3, 1), 100.0)
    adv, _ = compute_gae(REWARDS, VALUES, AT_STEP_1, AT_STEP_1, GAMMA, LAM, final_values=final_values)
    _close(adv, [0.68, -1.0, 2.3])


def test_gae_envs_are_independent_and_lambda_one_gives_discounted_returns():
    # lambda = 1, gamma = 0.5, V = 0: advantages are plain discounted returns.
    # env 0: r = [1, 1, 1]    -> [1 + 0.5*1.5, 1 + 0.5*1, 1] = [1.75, 1.5, 1]
    # env 1: r = [0, 0, 4]    -> [1, 2, 4]
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 4.0]])
    values = torch.zeros(4, 2)
    none = torch.zeros(3, 2, dtype=torch.bool)
    adv, ret = compute_gae(rewards, values, none, none, 0.5, 1.0)
    _close(adv, [[1.75, 1.0], [1.5, 2.0], [1.0, 4.0]])
    torch.testing.assert_close(ret, adv)


def test_gae_rejects_values_without_bootstrap_row():
    with pytest.raises(ValueError, match="T \\+ 1"):
        compute_gae(REWARDS, VALUES[:3], NO, NO, GAMMA, LAM)


def test_first_episode_mask_and_returns():
    # env 0 ends at step 1, env 1 never ends, env 2 ends at step 0 and again at step 2
    dones = torch.tensor([[False, False, True], [True, False, False], [False, False, True]])
    rewards = torch.tensor([[1.0, 1.0, 5.0], [2.0, 1.0, 7.0], [4.0, 1.0, 9.0]])
    mask = first_episode_mask(dones)
    assert mask.tolist() == [[True, True, True], [True, True, False], [False, True, False]]
    _close(episode_returns(rewards, dones), [3.0, 3.0, 5.0])


def test_grpo_advantages_by_hand():
    # group 0 = [3, 0, 0]: mean 1, unbiased std sqrt((4 + 1 + 1) / 2) = sqrt(3)
    #   -> [2/sqrt(3), -1/sqrt(3), -1/sqrt(3)]
    # group 1 = [1, 1, 1]: std 0 -> all 0
    scores = torch.tensor([3.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    s3 = math.sqrt(3.0)
    _close(grpo_advantages(scores, group_size=3, eps=1e-12), [2 / s3, -1 / s3, -1 / s3, 0.0, 0.0, 0.0])


def test_grpo_groups_are_contiguous_envs():
    # [0, 1 | 1, 0]: mean 0.5, std sqrt(0.5) per group -> +-0.5/0.70711 = +-0.70711
    adv = grpo_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]), group_size=2)
    _close(adv, [-0.707106, 0.707106, 0.707106, -0.707106])


def test_grpo_rejects_bad_group_size():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="group_size >= 2"):
        grpo_advantages(torch.zeros(4), group_size=1)


def test_nonuniform_group_mask_drops_all_success_and_all_failure_groups():
    success = torch.tensor([1, 1, 0, 0, 0, 0, 1, 1, 1])  # groups of 3: mixed, all-fail, all-success
    mask = nonuniform_group_mask(success, group_size=3)
    assert mask.tolist() == [True, True, True, False, False, False, False, False, False]


def test_normalize_advantages_with_mask():
    # valid [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]; the masked 10 becomes 0
    adv = torch.tensor([1.0, 2.0, 3.0, 10.0])
    out = normalize_advantages(adv, torch.tensor([True, True, True, False]))
    _close(out, [-1.0, 0.0, 1.0, 0.0])
    # unmasked: mean 4, unbiased std sqrt((9 + 4 + 1 + 36) / 3) = sqrt(50/3)
    _close(normalize_advantages(adv), [(x - 4.0) / math.sqrt(50 / 3) for x in [1.0, 2.0, 3.0, 10.0]])
