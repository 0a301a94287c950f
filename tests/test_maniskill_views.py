"""What the ManiSkill adapter renders and gives beside the camera images: only the cameras the
policy reads, and with ``obs_mode: rgb+state`` the full state vector of ``obs_mode: state`` (so
that a state policy drives an env that records what a VLA sees, embodied/record.py)."""

from __future__ import annotations

import numpy as np
import pytest

from embodied.config import load_env_config
from envs import make_vector_env
from envs.maniskill import PRIVILEGED_STATES
from envs.vector_env import EnvSetupError

SMALL = ["init_params.camera_heights=32", "init_params.camera_widths=32", "init_params.robot_uids=panda_wristcam"]


def sensors(env) -> list[str]:
    """The cameras ManiSkill renders in a one-env vector env (which steps in this process)."""
    return list(env.sim.env.env.unwrapped._sensors)


def test_only_the_cameras_the_policy_reads_are_rendered():
    with make_vector_env(load_env_config("maniskill_push_cube", SMALL + [
            "init_params.obs_mode=rgb", "init_params.wrist_camera=null"]), num_envs=1) as env:
        assert set(env.reset()) == {"main_images", "states", "task_descriptions"}
        assert sensors(env) == ["base_camera"]  # the robot's hand camera is left out
    with pytest.raises(EnvSetupError, match=r"main_camera='front' is not a camera of PushCube-v1; "
                                            r"it has \['base_camera', 'hand_camera'\]"):
        make_vector_env(load_env_config("maniskill_push_cube", SMALL + [
            "init_params.obs_mode=rgb", "init_params.main_camera=front"]), num_envs=1)


def test_rgb_state_gives_the_state_envs_states_beside_the_images():
    """Same seeds and actions: ``privileged_states`` of rgb+state are the states of a state env,
    ``states`` the proprioception of an rgb env (qpos, qvel, tcp pose: no cube or goal)."""
    actions = np.random.default_rng(0).uniform(-1, 1, (1, 3, 8)).astype(np.float32)
    seen = {}
    for mode in ("state", "rgb", "rgb+state"):
        with make_vector_env(load_env_config("maniskill_push_cube", SMALL + [f"init_params.obs_mode={mode}"]),
                             num_envs=1) as env:
            seen[mode] = [env.reset([5]), env.chunk_step(actions)[0]]
    for step in range(2):
        both, state, rgb = seen["rgb+state"][step], seen["state"][step], seen["rgb"][step]
        np.testing.assert_array_equal(both[PRIVILEGED_STATES], state["states"])
        np.testing.assert_array_equal(both["states"], rgb["states"])
        np.testing.assert_array_equal(both["main_images"], rgb["main_images"])
    assert seen["state"][0]["states"].shape == (1, 35) and seen["rgb"][0]["states"].shape == (1, 25)
    assert not np.array_equal(seen["state"][0]["states"], seen["state"][1]["states"])  # it moved
