"""ManiSkill3 behind the vector-env interface: real tasks on the CPU simulation, one process per
env, on the Vulkan device of scripts/setup_vulkan.sh."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import imageio
import numpy as np
import pytest
import torch

from envs.experts import push_cube
from envs.maniskill import TASK_DESCRIPTIONS, ManiSkillVectorEnv, check_params
from envs.maniskill_scene import ManiSkillEnv
from envs.subproc import SubprocVectorEnv
from embodied.config import load_env_config
from envs import make_vector_env
from envs.vector_env import EnvSetupError, VectorEnv

ROOT = Path(__file__).resolve().parent.parent
PUSH = ["init_params.control_mode=pd_ee_delta_pos"]


def options(**overrides) -> dict:
    base = dict(auto_reset=False, ignore_terminations=False, use_fixed_reset_state_ids=False,
                group_size=1, max_episode_steps=15, use_rel_reward=False, reward_coef=1.0, seed=0)
    return {**base, **overrides}


def run_push(env: VectorEnv, ids: list[int], chunks: int = 5, chunk: int = 3) -> list[tuple]:
    """Every chunk_step's (obs, rewards, terminations, truncations, infos), the chunk's actions
    planned from the observation before it (open loop inside the chunk)."""
    obs = env.reset(np.array(ids))
    out = []
    for _ in range(chunks):
        actions = np.repeat(push_cube(obs["states"])[:, None], chunk, axis=1)
        step = env.chunk_step(actions)
        out.append(step)
        obs = step[0]
    return out


@pytest.fixture(scope="module")
def push_sim():
    """Four PushCube envs (state obs, end-effector control) reused under several options."""
    params = check_params(load_env_config("maniskill_push_cube", PUSH).init_params)
    sim = SubprocVectorEnv([functools.partial(ManiSkillEnv, params, 50)] * 4,
                           preload=["envs.maniskill_scene"])
    yield sim
    sim.close()


# Reset states (ManiSkill seeds) whose cubes the scripted pusher brings home within 15 steps
# with 3-step chunks (ids 0 and 7), and one it does not (id 1).
WIN, WIN_FAST, MISS = 0, 7, 1


def test_state_observations(push_sim):
    obs = VectorEnv(push_sim, **options()).reset()
    assert set(obs) == {"states", "task_descriptions"}
    assert obs["states"].shape == (4, 35) and obs["states"].dtype == np.float32
    assert obs["task_descriptions"] == [TASK_DESCRIPTIONS["PushCube-v1"]] * 4


def test_reset_states_are_reproducible_and_shared_within_groups(push_sim):
    grouped = VectorEnv(push_sim, **options(use_fixed_reset_state_ids=True, group_size=2))
    states = grouped.reset()["states"]
    np.testing.assert_array_equal(states[0], states[1])
    np.testing.assert_array_equal(states[2], states[3])
    assert not np.allclose(states[0], states[2])
    explicit = grouped.reset([5, 5, 6, 6])["states"]
    np.testing.assert_array_equal(explicit[0], explicit[1])
    assert not np.allclose(explicit[0], explicit[2])
    # a separately built env holding global envs 2..3 starts exactly like rows 2..3 above
    cfg = load_env_config("maniskill_push_cube", PUSH + [
        "use_fixed_reset_state_ids=true", "group_size=2", "max_episode_steps=15"])
    with make_vector_env(cfg, num_envs=2, seed_offset=2) as other:
        np.testing.assert_array_equal(other.reset()["states"], states[2:])
        np.testing.assert_array_equal(other.reset([5, 6])["states"], explicit[1:3])


def test_chunks_end_episodes_in_the_last_slot(push_sim):
    steps = run_push(VectorEnv(push_sim, **options()), [WIN, MISS, WIN_FAST, MISS])
    rewards = np.concatenate([s[1] for s in steps], axis=1)  # [4, 15]
    terms = np.stack([s[2] for s in steps], axis=1)  # [4, chunks, 3]
    truncs = np.stack([s[3] for s in steps], axis=1)
    assert not terms[:, :, :-1].any() and not truncs[:, :, :-1].any()
    ends = [np.flatnonzero(s[4]["done"]) for s in steps]
    final = steps[-1][4]
    for row in (0, 2):  # terminated by success before the time limit
        (chunk,) = [c for c, e in enumerate(ends) if row in e]
        length = int(steps[chunk][4]["episode_length"][row])
        assert terms[row, chunk, -1] and not truncs[row].any()
        assert chunk * 3 < length <= chunk * 3 + 3 and length < 15
        # the episode ends at its first success (normalized reward 1), mid-chunk or not
        assert length == np.flatnonzero(rewards[row] >= 1.0)[0] + 1
        assert not rewards[row, length:].any()  # the rest of the chunk and later chunks
        assert final["success"][row] and final["success_once"][row]
        assert final["episode_return"][row] == pytest.approx(rewards[row].sum(), rel=1e-5)
    for row in (1, 3):  # truncated at max_episode_steps
        assert truncs[row, -1, -1] and truncs[row].sum() == 1 and not terms[row].any()
        assert final["episode_length"][row] == 15 and not final["success_once"][row]
    np.testing.assert_array_equal(rewards[1], rewards[3])  # same state, same actions


def test_ignore_terminations_runs_to_max_episode_steps(push_sim):
    steps = run_push(VectorEnv(push_sim, **options(ignore_terminations=True)),
                     [WIN, MISS, WIN_FAST, MISS])
    assert not any(s[2].any() for s in steps)
    assert all(s[3][:, -1].all() for s in steps[-1:]) and not any(s[3].any() for s in steps[:-1])
    final = steps[-1][4]
    assert final["episode_length"].tolist() == [15] * 4
    assert final["success_once"].tolist() == [True, False, True, False]


def test_auto_reset_once_per_chunk_keeps_the_final_observation(push_sim):
    steps = run_push(VectorEnv(push_sim, **options(auto_reset=True)), [WIN, MISS, WIN_FAST, MISS])
    resets = 0
    for c, (obs, _, _, _, infos) in enumerate(steps):
        done = infos["done"]
        if not done.any():
            assert "final_obs" not in infos
            continue
        resets += done.sum()
        final = infos["final_obs"]["states"]
        np.testing.assert_array_equal(final[~done], obs["states"][~done])
        assert not np.allclose(final[done], obs["states"][done])  # a new episode began
        if c + 1 < len(steps):
            assert (steps[c + 1][4]["episode_length"][done] == 3).all()
    assert resets == 4  # two successes and, at the time limit, the two misses


def test_relative_rewards_sum_to_last_minus_first(push_sim):
    absolute = run_push(VectorEnv(push_sim, **options()), [WIN, MISS, WIN_FAST, MISS])
    relative = run_push(VectorEnv(push_sim, **options(use_rel_reward=True, reward_coef=2.0)),
                        [WIN, MISS, WIN_FAST, MISS])
    lengths = absolute[-1][4]["episode_length"]
    r_abs = np.concatenate([s[1] for s in absolute], axis=1)
    r_rel = np.concatenate([s[1] for s in relative], axis=1)
    for row, n in enumerate(lengths):
        assert r_rel[row, :n].sum() == pytest.approx(2 * (r_abs[row, n - 1] - r_abs[row, 0]), abs=1e-4)
        np.testing.assert_allclose(r_rel[row, 1:n], 2 * np.diff(r_abs[row, :n]), atol=1e-5)
        assert not r_rel[row, n:].any()
    assert relative[-1][4]["episode_return"] == pytest.approx(r_rel.sum(1), abs=1e-4)


def test_a_rebuilt_env_continues_the_episode_numbering(push_sim):
    env = VectorEnv(push_sim, **options(auto_reset=True, ignore_terminations=True, max_episode_steps=6))
    assert env.next_episodes().tolist() == [0] * 4
    env.reset()
    assert env.next_episodes().tolist() == [0] * 4  # reset into, not stepped: a rebuild restarts it
    env.chunk_step(np.zeros((4, 3, env.action_dim)))
    assert env.next_episodes().tolist() == [1] * 4  # in flight: a rebuild starts the next one
    obs, *_, infos = env.chunk_step(np.zeros((4, 3, env.action_dim)))
    assert infos["done"].all()  # the time limit, and an auto-reset into episode 1
    numbers = env.next_episodes()
    assert numbers.tolist() == [1] * 4

    rebuilt = VectorEnv(push_sim, **options(ignore_terminations=True, max_episode_steps=6))
    rebuilt.set_next_episodes(numbers)
    with pytest.raises(RuntimeError, match="before reset"):
        rebuilt.chunk_step(np.zeros((4, 3, env.action_dim)))
    np.testing.assert_array_equal(rebuilt.reset()["states"], obs["states"])
    assert not np.allclose(VectorEnv(push_sim, **options()).reset()["states"], obs["states"])
    with pytest.raises(ValueError, match="expected 4 integers >= 0"):
        rebuilt.set_next_episodes([1, 1])


@pytest.mark.parametrize("name, task", [("maniskill_push_cube", "PushCube-v1"),
                                        ("maniskill_pick_cube", "PickCube-v1"),
                                        ("maniskill_stack_cube", "StackCube-v1")])
@pytest.mark.slow
def test_task_configs_build_and_step(name, task):
    cfg = load_env_config(name, ["init_params.obs_mode=state"])
    assert cfg.init_params.id == task
    with make_vector_env(cfg, num_envs=1) as env:
        obs = env.reset()
        assert obs["task_descriptions"] == [TASK_DESCRIPTIONS[task]]
        obs, rewards, *_ = env.chunk_step(np.zeros((1, 2, env.action_dim)))
        assert rewards.shape == (1, 2) and np.isfinite(rewards).all()
        assert env.sim.env.env.unwrapped.render_mode is None  # no video, nothing rendered


@pytest.mark.slow
def test_rgb_cameras_and_video(tmp_path):
    """StackCube's robot carries a wrist camera; sizes come from init_params; the video wrapper
    tiles both cameras of both envs."""
    cfg = load_env_config("maniskill_stack_cube", [
        "init_params.camera_heights=48", "init_params.camera_widths=64", "video_cfg.save_video=true",
        f"video_cfg.video_base_dir={tmp_path}", "video_cfg.fps=5"])
    env = make_vector_env(cfg, num_envs=2)
    pids = env.sim.pids
    try:
        obs = env.reset()
        for key in ("main_images", "wrist_images"):
            assert obs[key].shape == (2, 48, 64, 3) and obs[key].dtype == np.uint8
            assert obs[key].std() > 5  # a rendered scene, not a blank image
        assert obs["states"].dtype == np.float32 and obs["states"].shape[0] == 2
        assert not np.array_equal(obs["main_images"], obs["wrist_images"])
        for _ in range(3):
            obs, *_ = env.chunk_step(np.zeros((2, 2, env.action_dim)))
    finally:
        env.close()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()
    (path,) = env.paths
    frames = np.stack(imageio.mimread(path, memtest=False))
    assert frames.shape == (7, 48, 2 * 2 * 64, 3)  # reset + 3 chunks x 2 steps; 2 envs x (main | wrist)


@pytest.mark.slow
def test_state_observations_with_video_render_the_scene(tmp_path):
    """PushCube with obs_mode state has no cameras: its scene is rendered at the camera size for
    the video (one frame per reset and env step, also across an auto-reset), and the observations
    stay states only."""
    cfg = load_env_config("maniskill_push_cube", [
        "init_params.camera_heights=48", "init_params.camera_widths=64", "video_cfg.save_video=true",
        f"video_cfg.video_base_dir={tmp_path}", "video_cfg.info_on_video=false",
        "max_episode_steps=4", "auto_reset=true"])
    rng = np.random.default_rng(0)
    with make_vector_env(cfg, num_envs=2, name="eval_rank0_stage0") as env:
        obs = env.reset()
        assert set(obs) == {"states", "task_descriptions"}
        for chunk in range(3):
            obs, _, _, _, infos = env.chunk_step(rng.uniform(-1, 1, (2, 2, env.action_dim)))
            assert set(obs) == {"states", "task_descriptions"}
            if chunk == 1:  # step 4: the episodes end and auto-reset
                assert set(infos["final_obs"]) == {"states", "task_descriptions"}
    (path,) = env.paths
    assert path == tmp_path / "eval_rank0_stage0_0000.mp4"
    frames = np.stack(imageio.mimread(path, memtest=False)).astype(np.float32)
    assert frames.shape == (7, 48, 2 * 64, 3)  # reset + 3 chunks x 2 steps; 2 envs side by side
    assert frames.std(axis=(1, 2, 3)).min() > 5  # a rendered scene, not a blank image
    assert np.abs(frames[1] - frames[0]).mean() > 0.5  # the arm moved


@pytest.mark.slow
def test_the_wrist_camera_panda_warning_is_dropped_and_other_warnings_show_once():
    """panda_wristcam is the Panda plus a camera: ManiSkill's "not in the task's list of
    supported robots", printed at every env construction, is known harmless for Panda tasks."""
    import logging

    shown: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    log = logging.getLogger("mani_skill ")  # (sic)
    log.addHandler(handler)
    try:
        cfg = load_env_config("maniskill_pick_cube", ["init_params.robot_uids=panda_wristcam", "init_params.obs_mode=rgb",
                                                      "init_params.camera_heights=32", "init_params.camera_widths=32"])
        for _ in range(2):
            make_vector_env(cfg, num_envs=1).close()
        for _ in range(3):
            log.warning("a warning of ManiSkill's own")
    finally:
        log.removeHandler(handler)
    assert shown == ["a warning of ManiSkill's own"]


def test_bad_settings_fail_before_any_simulator_starts():
    cfg = load_env_config("maniskill_push_cube")
    cases = [("init_params.id=PushCub-v1", r"not a ManiSkill task; did you mean \['PushCube-v1'"),
             ("init_params.obs_mode=pointcloud", r"obs_mode='pointcloud': expected one of"),
             ("init_params.sim_backend=tpu", "sim_backend='tpu'"),
             ("init_params.camera_heights=0", "camera_heights=0"),
             ("init_params.id=PickSingleYCB-v1", "needs assets that are not downloaded.*download_asset")]
    for override, message in cases:
        with pytest.raises(EnvSetupError, match=message):
            ManiSkillVectorEnv(load_env_config("maniskill_push_cube", [override]), num_envs=1)
    with pytest.raises(EnvSetupError, match="group_size=3"):
        ManiSkillVectorEnv(load_env_config("maniskill_push_cube", ["group_size=3"]), num_envs=2)
    with pytest.raises(KeyError, match="unknown env type 'mujoco'"):
        make_vector_env({**cfg, "env_type": "mujoco"}, num_envs=1)


def test_unsupported_control_mode_names_the_supported_ones():
    cfg = load_env_config("maniskill_push_cube", ["init_params.control_mode=pd_ee_twist"])
    with pytest.raises(EnvSetupError,
                       match=r"control_mode='pd_ee_twist' is not supported.*pd_ee_delta_pose"):
        make_vector_env(cfg, num_envs=1)


@pytest.mark.slow
def test_missing_vulkan_device_says_how_to_fix_it(tmp_path):
    script = ("from envs.maniskill import check_params\nfrom envs.maniskill_scene import ManiSkillEnv\n"
              "from embodied.config import load_env_config\n"
              "p = check_params(load_env_config('maniskill_push_cube').init_params)\n"
              "ManiSkillEnv(p, 50)\n")
    env = {**os.environ, "VK_ICD_FILENAMES": str(tmp_path / "no_such_icd.json"), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode != 0
    assert "EnvSetupError: ManiSkill needs a Vulkan device" in run.stderr
    assert "scripts/setup_vulkan.sh" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without a GPU")
def test_gpu_backend_without_cuda_fails_clearly():
    cfg = load_env_config("maniskill_push_cube", ["init_params.sim_backend=gpu"])
    with pytest.raises(EnvSetupError, match="sim_backend=gpu needs a CUDA GPU"):
        make_vector_env(cfg, num_envs=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_backend_batches_envs_and_groups():
    cfg = load_env_config("maniskill_pick_cube", [
        "init_params.sim_backend=gpu", "use_fixed_reset_state_ids=true", "group_size=2",
        "auto_reset=true"])
    with make_vector_env(cfg, num_envs=4) as env:
        obs = env.reset()
        assert obs["main_images"].shape == (4, 128, 128, 3)
        np.testing.assert_array_equal(obs["states"][0], obs["states"][1])
        assert not np.allclose(obs["states"][0], obs["states"][2])
        obs, rewards, terms, truncs, infos = env.chunk_step(np.zeros((4, 5, env.action_dim)))
        assert rewards.shape == (4, 5) and infos["success"].shape == (4,)
