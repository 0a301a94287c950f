"""Reset states of a finite set (LIBERO's task x init state, held-out prompts): even coverage in
training, and the eval protocol that starts every state exactly once however many envs and
ranks run, on a small counting sim (the real LIBERO paths are in test_libero.py)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.episode_stats import EpisodeStats
from envs.vector_env import EnvSetupError, VectorEnv


class CountingSim:
    """A ``BatchedSim`` whose observation is each env's reset state id; an episode lasts one
    step and always succeeds."""

    action_dim = 1

    def __init__(self, num_envs: int, num_reset_states: int | None):
        self.num_envs = num_envs
        self.num_reset_states = num_reset_states
        self.task_descriptions = ["count"] * num_envs
        self.ids = np.zeros(num_envs, np.int64)

    def reset(self, env_ids, state_ids):
        self.ids[env_ids] = state_ids
        return {"states": self.ids[:, None].astype(np.float32)}

    def step_chunk(self, actions):
        b, c = actions.shape[:2]
        ones = np.ones((b, c), bool)
        return {"states": self.ids[:, None].astype(np.float32)}, ones.astype(np.float32), ones, ones

    def close(self):
        pass


def vector_env(num_envs: int, states: int | None, seed_offset: int = 0, **options) -> VectorEnv:
    base = dict(auto_reset=False, ignore_terminations=False, use_fixed_reset_state_ids=False,
                group_size=1, max_episode_steps=1, use_rel_reward=False, reward_coef=1.0, seed=3,
                seed_offset=seed_offset)
    return VectorEnv(CountingSim(num_envs, states), **{**base, **options})


def started(env: VectorEnv, episodes: int) -> list[int]:
    ids = []
    for _ in range(episodes):
        ids += env.reset()["states"][:, 0].astype(int).tolist()
        env.chunk_step(np.zeros((env.num_envs, 1, 1), np.float32))
    return ids


@pytest.mark.parametrize("envs,states", [(4, 10), (3, 7), (8, 8), (5, 12)])
def test_training_visits_a_finite_set_evenly(envs, states):
    env = vector_env(envs, states)
    counts = np.bincount(started(env, 6 * states), minlength=states)
    assert (counts == 6 * envs).all()  # every state equally often over whole cycles
    # in starting order, each cycle of ``states`` episodes is a fresh random permutation
    ids = started(vector_env(envs, states), states)
    cycles = [ids[i * states:(i + 1) * states] for i in range(3)]
    assert all(sorted(c) == list(range(states)) for c in cycles)
    assert cycles[0] != cycles[1] != cycles[2]


def test_even_coverage_holds_across_ranks_and_groups():
    # two workers of 4 envs each, groups of 2: 4 streams of one sequence over 10 states
    ranks = [vector_env(4, 10, seed_offset=4 * r, total_num_envs=8, group_size=2,
                        use_fixed_reset_state_ids=True) for r in range(2)]
    ids = np.array([started(env, 10) for env in ranks])  # [rank, episode * env]
    per_group = ids.reshape(2, 10, 2, 2)  # rank, episode, group, member
    assert (per_group[..., 0] == per_group[..., 1]).all()  # a group shares its state
    counts = np.bincount(per_group[..., 0].ravel(), minlength=10)
    assert (counts == 4).all()  # 40 group episodes over 10 states


def test_unbounded_seeds_are_drawn_at_random():
    env = vector_env(4, None)
    ids = started(env, 3)
    assert len(set(ids)) == 12 and max(ids) > 10**6


def test_ordered_goes_through_the_states_in_order_and_random_draws_with_replacement():
    """reset_state_order: ordered (RLinf's use_ordered_reset_state_ids true) and random (false)."""
    assert started(vector_env(4, 10, reset_state_order="ordered"), 5) == [i % 10 for i in range(20)]
    assert started(vector_env(4, None, reset_state_order="ordered"), 2) == list(range(8))  # seeds 0, 1, ...
    drawn = started(vector_env(4, 10, reset_state_order="random"), 50)
    counts = np.bincount(drawn, minlength=10)
    # 200 independent draws from 10 states: not the exact 20 each of a cycle, but all of them seen
    assert counts.min() > 0 and len(set(counts.tolist())) > 1
    assert drawn == started(vector_env(4, 10, reset_state_order="random"), 50)  # seeded
    with pytest.raises(EnvSetupError, match="reset_state_order='random' has no effect with env.each_reset_state_once"):
        vector_env(2, 10, each_reset_state_once=True, reset_state_order="random")


@pytest.mark.parametrize("ranks,per_rank,states", [(1, 4, 10), (2, 3, 10), (2, 4, 8), (3, 2, 5)])
def test_each_reset_state_once_covers_every_state_exactly_once(ranks, per_rank, states):
    total = ranks * per_rank
    envs = [vector_env(per_rank, states, seed_offset=per_rank * r, total_num_envs=total,
                       each_reset_state_once=True) for r in range(ranks)]
    rounds = envs[0].rounds
    assert rounds == -(-states // total)
    counted = []
    stats = EpisodeStats()
    for env in envs:
        for _ in range(rounds):
            ids = env.reset()["states"][:, 0].astype(int)
            infos = env.chunk_step(np.zeros((per_rank, 1, 1), np.float32))[4]
            counted += ids[~infos["extra_episode"]].tolist()
            stats.update(infos)
    assert sorted(counted) == list(range(states))
    assert stats.num_episodes == states  # extra episodes (filling the batch) are not counted
    # a consecutive run per env: a LIBERO env stays on one task for consecutive init states
    env = vector_env(2, 6, each_reset_state_once=True)
    assert [env.reset()["states"][:, 0].tolist() for _ in range(3)] == [[0, 3], [1, 4], [2, 5]]
    # the next evaluation starts over from the same states
    env.set_next_episodes([0, 0])
    assert env.reset()["states"][:, 0].tolist() == [0, 3]


def test_each_reset_state_once_needs_a_finite_set_and_no_auto_reset():
    with pytest.raises(EnvSetupError, match="finite set of reset states"):
        vector_env(2, None, each_reset_state_once=True)
    with pytest.raises(EnvSetupError, match="needs env.auto_reset: false"):
        vector_env(2, 10, each_reset_state_once=True, auto_reset=True)
