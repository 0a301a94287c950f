"""SubprocVectorEnv (real processes, real shared memory) and VectorEnv's chunk semantics, on a
small scripted env whose episode ends exactly when the test says (ManiSkill runs the same paths
in test_maniskill.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from envs.episode_stats import EpisodeStats
from envs.protocol import STEP_FRAMES
from envs.subproc import InProcessEnv, SubprocVectorEnv, single_env_batch
from envs.vector_env import EnvSetupError, VectorEnv


class ScriptedEnv:
    """Deterministic: observations encode (state id, step, pid); reward 0.1 * step + state id;
    success from step ``succeed_at`` on; ``fail`` makes construction or stepping go wrong."""

    num_reset_states = 100
    action_dim = 2

    def __init__(self, succeed_at: int = 10**9, fail: str = ""):
        if fail == "init":
            raise EnvSetupError("env.init_params.id='Broken-v0' is not a task")
        self.succeed_at = succeed_at
        self.fail = fail
        self.obs_spec = {"states": ((3,), np.dtype(np.float32)),
                         "main_images": ((4, 6, 3), np.dtype(np.uint8))}
        self.task_description = f"succeed at step {succeed_at}"
        self.state_id = self.t = 0

    def observation(self) -> dict[str, np.ndarray]:
        return {"states": np.array([self.state_id, self.t, os.getpid()], np.float32),
                "main_images": np.full((4, 6, 3), (self.state_id * 10 + self.t) % 256, np.uint8)}

    def reset(self, state_id: int) -> None:
        self.state_id, self.t = state_id, 0

    def step(self, action: np.ndarray, observe: bool = True) -> tuple[float, bool, bool]:
        self.t += 1
        if self.fail == "crash" and self.t == 2:
            os._exit(3)
        if self.fail == "raise" and self.t == 2:
            raise ZeroDivisionError("scripted failure")
        success = self.t >= self.succeed_at
        return 0.1 * self.t + self.state_id + float(action[0]), success, success

    def close(self) -> None:
        pass


def make_fns(*succeed_at: int, fail: str = "") -> list:
    import functools

    return [functools.partial(ScriptedEnv, s, fail) for s in succeed_at]


def shm_segments() -> set[str]:
    return set(os.listdir("/dev/shm"))


def assert_gone(pids: list[int], shm_name: str | None, before: set[str]) -> None:
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"env process {pid} survived close()"
    if shm_name is not None:
        assert not Path(f"/dev/shm/{shm_name}").exists()
    assert shm_segments() <= before


def vector_env(sim, **overrides) -> VectorEnv:
    options = dict(auto_reset=False, ignore_terminations=False, use_fixed_reset_state_ids=False,
                   group_size=1, max_episode_steps=6, use_rel_reward=False, reward_coef=1.0, seed=0)
    return VectorEnv(sim, **{**options, **overrides})


@pytest.fixture(scope="module")
def sim():
    """Env 0 succeeds at its 4th step (mid-chunk for chunks of 3), env 1 never does."""
    s = SubprocVectorEnv(make_fns(4, 10**9))
    yield s
    s.close()


def test_a_process_can_hold_a_block_of_envs():
    sim = SubprocVectorEnv(make_fns(10**9, 10**9, 10**9, 10**9, 10**9), num_processes=2)
    try:
        assert len(sim.pids) == 2
        obs = sim.reset(np.arange(5), np.array([1, 2, 3, 4, 5]))
        owners = obs["states"][:, 2].tolist()  # each env writes its process's pid
        assert owners == [sim.pids[0]] * 3 + [sim.pids[1]] * 2
        partial = sim.reset(np.array([3]), np.array([8]))
        np.testing.assert_array_equal(partial["states"][:, 0], [1, 2, 3, 8, 5])
        _, rewards, _, _ = sim.step_chunk(np.zeros((5, 2, 2), np.float32))
        np.testing.assert_allclose(rewards[:, 0], [1.1, 2.1, 3.1, 8.1, 5.1], rtol=1e-6)
    finally:
        sim.close()


def test_observations_come_through_shared_memory_from_separate_processes(sim):
    assert len(set(sim.pids)) == 2 and os.getpid() not in sim.pids
    assert sim.shm_name in shm_segments()
    obs = sim.reset(np.array([0, 1]), np.array([7, 9]))
    assert obs["states"].dtype == np.float32 and obs["states"].shape == (2, 3)
    assert obs["main_images"].dtype == np.uint8 and obs["main_images"].shape == (2, 4, 6, 3)
    np.testing.assert_array_equal(obs["states"][:, :2], [[7, 0], [9, 0]])
    assert obs["states"][:, 2].tolist() == sim.pids  # written by each env's own process
    obs2, rewards, terminated, success = sim.step_chunk(np.zeros((2, 3, 2), np.float32))
    np.testing.assert_array_equal(obs2["states"][:, :2], [[7, 3], [9, 3]])
    np.testing.assert_allclose(rewards, [[7.1, 7.2, 7.3], [9.1, 9.2, 9.3]], rtol=1e-6)
    assert rewards.dtype == np.float32 and terminated.dtype == bool and success.dtype == bool
    assert obs["states"][0, 1] == 0  # returned arrays are copies, not views of the shared block
    partial = sim.reset(np.array([1]), np.array([5]))
    np.testing.assert_array_equal(partial["states"][:, :2], [[7, 3], [5, 0]])


def test_chunk_reports_done_in_last_slot_and_zeroes_rewards_after_it(sim):
    env = vector_env(sim)
    env.reset(np.array([0, 1]))
    obs, rewards, terms, truncs, infos = env.chunk_step(np.zeros((2, 3, 2)))
    assert not terms.any() and not truncs.any() and not infos["done"].any()
    obs, rewards, terms, truncs, infos = env.chunk_step(np.zeros((2, 3, 2)))
    # env 0 succeeds at step 4 (slot 0): reported in slot 2, nothing after step 4 counts
    assert terms.tolist() == [[False, False, True], [False, False, False]]
    assert truncs.tolist() == [[False, False, False], [False, False, True]]  # env 1: 6 steps
    np.testing.assert_allclose(rewards[0], [0.4, 0, 0], atol=1e-6)
    np.testing.assert_allclose(rewards[1], [1.4, 1.5, 1.6], atol=1e-6)
    assert infos["done"].tolist() == [True, True]
    assert infos["episode_length"].tolist() == [4, 6]
    assert infos["success"].tolist() == [True, False]
    assert infos["success_once"].tolist() == [True, False]
    np.testing.assert_allclose(infos["episode_return"], [0.1 + 0.2 + 0.3 + 0.4, 6 + 0.1 * 21],
                               rtol=1e-6)
    assert "final_obs" not in infos
    # without auto_reset a finished env idles: no reward, never done again, figures frozen
    obs, rewards, terms, truncs, infos = env.chunk_step(np.ones((2, 3, 2)))
    assert not rewards.any() and not terms.any() and not truncs.any() and not infos["done"].any()
    assert infos["episode_length"].tolist() == [4, 6]


def test_auto_reset_once_per_chunk_keeps_final_observation(sim):
    env = vector_env(sim, auto_reset=True)
    env.reset(np.array([0, 1]))
    env.chunk_step(np.zeros((2, 3, 2)))
    obs, rewards, terms, truncs, infos = env.chunk_step(np.zeros((2, 3, 2)))
    assert infos["done"].tolist() == [True, True]
    # final observation: after all 6 executed steps of the chunk, before the reset
    np.testing.assert_array_equal(infos["final_obs"]["states"][:, :2], [[0, 6], [1, 6]])
    assert infos["final_obs"]["task_descriptions"] == obs["task_descriptions"]
    assert (obs["states"][:, 1] == 0).all()  # both envs start their next episode
    assert infos["episode_length"].tolist() == [4, 6]  # infos describe the finished episodes
    obs, rewards, terms, truncs, infos = env.chunk_step(np.zeros((2, 3, 2)))
    assert infos["episode_length"].tolist() == [3, 3] and not infos["done"].any()
    assert "final_obs" not in infos


def test_ignore_terminations_runs_to_max_episode_steps(sim):
    env = vector_env(sim, ignore_terminations=True)
    env.reset(np.array([0, 1]))
    env.chunk_step(np.zeros((2, 3, 2)))
    obs, rewards, terms, truncs, infos = env.chunk_step(np.zeros((2, 3, 2)))
    assert not terms.any() and truncs[:, -1].all()
    assert infos["episode_length"].tolist() == [6, 6]
    assert infos["success_once"].tolist() == [True, False]


def test_relative_rewards_sum_to_last_minus_first_and_are_scaled(sim):
    env = vector_env(sim, use_rel_reward=True, reward_coef=5.0, max_episode_steps=5)
    env.reset(np.array([0, 1]))
    actions = np.random.default_rng(0).uniform(-1, 1, (2, 5, 2))
    _, rewards, *_ = env.chunk_step(actions)
    absolute = 0.1 * np.arange(1, 6) + np.array([[0], [1]]) + actions[..., 0]
    absolute[0, 4:] = absolute[0, 3]  # env 0 ends at step 4
    np.testing.assert_allclose(rewards[:, 0], 0, atol=1e-6)
    np.testing.assert_allclose(rewards.sum(1), 5 * (absolute[:, -1] - absolute[:, 0]), rtol=1e-5)
    np.testing.assert_allclose(rewards[:, 1:4], 5 * np.diff(absolute[:, :4]), rtol=1e-5)


def test_groups_share_reset_states_reproducibly():
    sim = SubprocVectorEnv(make_fns(*[10**9] * 4))
    try:
        def first_ids(seed: int, fixed: bool, seed_offset: int = 0) -> list[int]:
            env = vector_env(sim, use_fixed_reset_state_ids=fixed, group_size=2, seed=seed,
                             seed_offset=seed_offset)
            return env.reset()["states"][:, 0].astype(int).tolist()

        a = first_ids(0, True)
        assert a[0] == a[1] and a[2] == a[3] and a[0] != a[2]
        assert first_ids(0, True) == a  # same seed, same states
        assert first_ids(1, True) != a
        assert first_ids(0, True, seed_offset=4) != a  # other workers get other groups
        free = first_ids(0, False)
        assert len(set(free)) == 4
        # auto-reset keeps groups together: members start their k-th episode alike
        env = vector_env(sim, use_fixed_reset_state_ids=True, group_size=2, auto_reset=True,
                         max_episode_steps=2)
        env.reset()
        obs, *_ = env.chunk_step(np.zeros((4, 2, 2)))
        ids = obs["states"][:, 0].astype(int).tolist()
        assert ids[0] == ids[1] and ids[2] == ids[3] and ids[:2] != a[:2]
        with pytest.raises(EnvSetupError, match="group_size"):
            vector_env(SubprocVectorEnv(make_fns(1, 1)), group_size=3)
    finally:
        sim.close()


def test_bad_reset_ids_and_actions_are_refused(sim):
    env = vector_env(sim)
    with pytest.raises(RuntimeError, match="reset"):
        vector_env(sim).chunk_step(np.zeros((2, 1, 2)))
    with pytest.raises(ValueError, match="reset_state_ids"):
        env.reset([0, 100])
    env.reset()
    with pytest.raises(ValueError, match=r"actions: expected shape \[2, chunk, 2\]"):
        env.chunk_step(np.zeros((2, 3)))


def test_episode_stats_collect_finished_episodes(sim):
    env = vector_env(sim, auto_reset=True)
    stats = EpisodeStats()
    env.reset(np.array([0, 1]))
    for _ in range(4):
        stats.update(env.chunk_step(np.zeros((2, 3, 2)))[-1])
    # episodes: env 0 ends at steps 4 and 4+4 (chunks 2 and 4), env 1 at 6 and 12
    assert stats.num_episodes == 4
    episodes = stats.episodes()
    assert sorted(episodes["length"].tolist()) == [4, 4, 6, 6]
    summary = stats.pop()
    assert summary["env/episodes"] == 4
    assert summary["env/success"] == 0.5 and summary["env/success_once"] == 0.5
    assert summary["env/length"] == 5.0
    # per task (the scripted envs' descriptions): env 0's task succeeds, env 1's never does
    assert summary["env/success_once/succeed_at_step_4"] == 1.0
    assert summary["env/episodes/succeed_at_step_4"] == 2
    assert summary["env/success_once/succeed_at_step_1000000000"] == 0.0
    assert summary["env/episodes/succeed_at_step_1000000000"] == 2
    assert stats.pop() == {}


def test_close_leaves_no_process_or_shared_memory():
    before = shm_segments()
    sim = SubprocVectorEnv(make_fns(1, 1, 1))
    pids, name = sim.pids, sim.shm_name
    sim.reset(np.arange(3), np.arange(3))
    sim.close()
    sim.close()  # twice is fine
    assert_gone(pids, name, before)


def test_failing_env_construction_cleans_up_and_keeps_the_message():
    import multiprocessing

    before, children = shm_segments(), set(multiprocessing.active_children())
    fns = make_fns(1) + make_fns(1, fail="init")
    with pytest.raises(EnvSetupError, match="Broken-v0"):
        SubprocVectorEnv(fns)
    assert set(multiprocessing.active_children()) <= children
    assert shm_segments() <= before


@pytest.mark.parametrize("fail, message", [("crash", r"died \(exit code 3\)"),
                                           ("raise", "ZeroDivisionError: scripted failure")])
def test_failing_env_step_raises_and_close_still_cleans_up(fail, message):
    before = shm_segments()
    sim = SubprocVectorEnv(make_fns(10, 10, fail=fail))
    pids, name = sim.pids, sim.shm_name
    sim.reset(np.arange(2), np.arange(2))
    with pytest.raises(RuntimeError, match=message):
        sim.step_chunk(np.zeros((2, 3, 2), np.float32))
    sim.close()
    assert_gone(pids, name, before)


def test_a_lone_env_steps_in_process_exactly_like_a_subprocess_one():
    def run(sim) -> list[np.ndarray]:
        """Every array the vector env returns over an episode with an auto-reset."""
        env = vector_env(sim, auto_reset=True, use_rel_reward=True)
        arrays = [env.reset([3])["states"][:, :2]]  # state id and step (column 2 is the pid)
        for _ in range(3):
            obs, rewards, terms, truncs, infos = env.chunk_step(np.full((1, 3, 2), 0.5))
            arrays += [obs["states"][:, :2], obs["main_images"], rewards, terms, truncs]
            arrays += [v for k, v in sorted(infos.items()) if k != "final_obs"]
        return arrays

    inproc = single_env_batch(make_fns(4))
    sub = SubprocVectorEnv(make_fns(4))
    try:
        assert isinstance(inproc, InProcessEnv)
        assert inproc.reset(np.array([0]), np.array([1]))["states"][0, 2] == os.getpid()
        for a, b in zip(run(inproc), run(sub), strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        inproc.close()
        sub.close()


def test_step_frames_hold_every_steps_images_in_and_out_of_process():
    """While a video records, a chunk also returns each step's images (STEP_FRAMES): the
    observation each env would give after that step, from processes and in-process alike."""
    for sim in (SubprocVectorEnv(make_fns(10, 10, 10), num_processes=2, step_frames=True),
                single_env_batch(make_fns(10), step_frames=True)):
        try:
            sim.reset(np.arange(sim.num_envs), np.arange(sim.num_envs))
            obs, *_ = sim.step_chunk(np.zeros((sim.num_envs, 4, 2), np.float32))
            frames = obs[STEP_FRAMES]
            assert set(frames) == {"main_images"} and frames["main_images"].shape == (sim.num_envs, 4, 4, 6, 3)
            expected = 10 * np.arange(sim.num_envs)[:, None] + np.arange(1, 5)  # state id * 10 + step
            np.testing.assert_array_equal(frames["main_images"][:, :, 0, 0, 0], expected)
            np.testing.assert_array_equal(frames["main_images"][:, -1], obs["main_images"])
        finally:
            sim.close()
