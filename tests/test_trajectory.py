"""Trajectory -> training samples, against hand-computed advantages."""

import math

import torch

from embodied.algorithms.trajectory import training_samples
from embodied.batch import Trajectory

ALGO = dict(reward_type="chunk_level", logprob_type="action_level", adv_type="gae", gamma=0.5,
            gae_lambda=1.0, use_kl_in_reward=True, kl_beta=0.0, kl_penalty="kl",
            filter_rewards=False, group_size=2, bootstrap_at_done="truncated",
            norm_adv_by_std_in_grpo=True)


def _traj(rewards, terminations=None, values=None, chunks=1, action_dim=2):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    if rewards.dim() == 2:
        rewards = rewards.unsqueeze(-1)
    steps, batch, _ = rewards.shape
    term = torch.zeros_like(rewards, dtype=torch.bool) if terminations is None else torch.tensor(terminations)
    if term.dim() == 2:
        term = term.unsqueeze(-1)
    logprobs = torch.full((steps, batch, chunks, action_dim), -0.5)
    return Trajectory(
        rewards=rewards, terminations=term, truncations=torch.zeros_like(term),
        actions=torch.zeros(steps, batch, chunks, action_dim), logprobs=logprobs,
        token_mask=torch.ones_like(logprobs, dtype=torch.bool),
        forward_inputs={"states": torch.arange(steps * batch * 3.0).reshape(steps, batch, 3)},
        values=None if values is None else torch.tensor(values, dtype=torch.float32),
    )


def test_gae_by_hand_two_steps():
    # delta_1 = 2 + 0.5 * 4 - 1 = 3; delta_0 = 1 + 0.5 * 1 - 0.5 = 1; A_0 = 1 + 0.5 * 3 = 2.5
    out = training_samples(_traj([[1.0], [2.0]], values=[[0.5], [1.0], [4.0]]), ALGO)
    assert out.advantages.tolist() == [2.5, 3.0]
    assert out.returns.tolist() == [3.0, 4.0]
    assert out.old_values.tolist() == [0.5, 1.0]
    assert out.old_logprobs.tolist() == [[-1.0], [-1.0]]  # action level: sum over 2 dims
    assert out.forward_inputs["states"].shape == (2, 3)
    assert out.mask.all()


def test_termination_stops_bootstrap():
    # step 0 terminates: A_0 = 1 - 0.5 = 0.5, and step 1 (a new episode) does not leak into it
    out = training_samples(_traj([[1.0], [2.0]], [[True], [False]], values=[[0.5], [1.0], [4.0]]), ALGO)
    assert out.advantages.tolist() == [0.5, 3.0]


def test_bootstrap_at_done_always_bootstraps_a_terminated_step():
    # step 0 terminates but bootstraps from its final observation's value 3:
    # A_0 = 1 + 0.5 * 3 - 0.5 = 2, and still no leak from step 1's new episode
    traj = _traj([[1.0], [2.0]], [[True], [False]], values=[[0.5], [1.0], [4.0]])
    traj.final_values = torch.tensor([[3.0], [0.0]])
    out = training_samples(traj, dict(ALGO, bootstrap_at_done="always"))
    assert out.advantages.tolist() == [2.0, 3.0]
    assert out.returns.tolist() == [2.5, 4.0]


def test_action_level_rewards_make_every_action_a_step():
    # one chunk of two actions: r = (1, 2), values per action V = (0.5, 1.0), bootstrap 4.0
    algo = dict(ALGO, reward_type="action_level")
    traj = _traj([[[1.0, 2.0]]], values=[[[0.5, 1.0]], [[4.0, 0.0]]], chunks=2)
    out = training_samples(traj, algo)
    assert out.advantages.tolist() == [[2.5, 3.0]]
    assert out.old_logprobs.shape == (1, 2)


def test_chunk_level_sums_the_chunk_rewards():
    traj = _traj([[[1.0, 2.0]]], values=[[0.0], [0.0]], chunks=2)
    assert training_samples(traj, ALGO).advantages.tolist() == [3.0]


def test_grpo_normalizes_first_episode_returns_within_groups():
    # envs 0,1 form a group; env 0 scores 1 (done at t0, its t1 is masked), env 1 scores 0
    # envs 2,3: scores 2 and 2 -> advantage 0
    algo = dict(ALGO, adv_type="grpo")
    rewards = [[1.0, 0.0, 1.0, 2.0], [5.0, 0.0, 1.0, 0.0]]
    dones = [[True, False, False, True], [False, False, False, False]]
    out = training_samples(_traj(rewards, dones), algo)
    a = 1 / math.sqrt(0.5)  # (1 - 0.5) / std([1, 0]) with the unbiased std
    expected = [[a / 2, -a / 2, 0.0, 0.0], [0.0, -a / 2, 0.0, 0.0]]
    assert torch.allclose(out.advantages.reshape(2, 4), torch.tensor(expected), atol=1e-5)
    assert out.mask.reshape(2, 4).tolist() == [[True, True, True, True], [False, True, True, False]]
    assert out.returns is None


def test_grpo_filter_drops_uniform_groups():
    algo = dict(ALGO, adv_type="grpo", filter_rewards=True)
    out = training_samples(_traj([[1.0, 0.0, 1.0, 1.0]], [[True] * 4]), algo)
    assert out.mask.tolist() == [True, True, False, False]


def test_kl_in_reward_lowers_rewards_by_beta_times_kl():
    algo = dict(ALGO, kl_beta=0.5, gamma=0.0)
    traj = _traj([[1.0]], values=[[0.0], [0.0]])
    ref = torch.full_like(traj.logprobs, -1.5)  # k1 per token: -0.5 - (-1.5) = 1, two tokens
    out = training_samples(traj, algo, ref_logprobs=ref)
    assert out.advantages.tolist() == [1.0 - 0.5 * 2.0]
    assert out.ref_logprobs is None


def test_kl_in_loss_passes_reference_logprobs_through():
    algo = dict(ALGO, kl_beta=0.5, use_kl_in_reward=False)
    traj = _traj([[1.0]], values=[[0.0], [0.0]])
    out = training_samples(traj, algo, ref_logprobs=torch.full_like(traj.logprobs, -1.5))
    assert out.ref_logprobs.tolist() == [[-3.0]]
