"""What the ManiSkill adapter renders and gives beside the camera images: only the cameras the
policy reads, and with ``obs_mode: rgb+state`` the full state vector of ``obs_mode: state`` (so
that a state policy drives an env that records what a VLA sees, embodied/record.py)."""

from __future__ import annotations

import numpy as np
import pytest

from embodied.config import load_env_config
from envs import make_vector_env
from envs.protocol import PRIVILEGED_STATES
from envs.vector_env import EnvSetupError

SMALL = ["init_params.camera_heights=32", "init_params.camera_widths=32", "init_params.robot_uids=panda_wristcam"]


def sensors(env) -> list[str]:
    """The cameras ManiSkill renders in a one-env vector env (which steps in this process)."""
    return list(env.sim.env.env.unwrapped._sensors)


@pytest.mark.slow
def test_only_the_cameras_the_policy_reads_are_rendered():
    with make_vector_env(load_env_config("maniskill_push_cube", SMALL + [
            "init_params.obs_mode=rgb", "init_params.wrist_camera=null"]), num_envs=1) as env:
        assert set(env.reset()) == {"main_images", "states", "task_descriptions"}
        assert sensors(env) == ["base_camera"]  # the robot's hand camera is left out
    with pytest.raises(EnvSetupError, match=r"main_camera='front' is not a camera of PushCube-v1; "
                                            r"it has \['base_camera', 'hand_camera'\]"):
        make_vector_env(load_env_config("maniskill_push_cube", SMALL + [
            "init_params.obs_mode=rgb", "init_params.main_camera=front"]), num_envs=1)


@pytest.mark.slow
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


def robot_triangles(env) -> int:
    scene = env.sim.env.env.unwrapped.scene.sub_scenes[0]
    return sum(len(part.triangles) for entity in scene.entities if entity.name.startswith("panda")
               for body in entity.components if type(body).__name__ == "RenderBodyComponent"
               for shape in body.render_shapes for part in shape.parts)


@pytest.mark.slow
def test_simplified_meshes_draw_the_same_scene_from_a_sixth_of_the_triangles():
    """``render_mesh_triangles``: same seed and actions, the Panda drawn from at most 2000
    triangles a mesh. The frames differ in a few edge pixels only, the arm is drawn where the
    simulation moved it, and the simulation itself is untouched (same states)."""
    push = ["init_params.obs_mode=rgb", "init_params.wrist_camera=null", "init_params.control_mode=pd_ee_delta_pos",
            "init_params.camera_heights=64", "init_params.camera_widths=64"]
    actions = np.tile(np.array([0.6, 0.3, -0.5, 0.0], np.float32), (1, 12, 1))
    seen, triangles = {}, {}
    for cap in ("null", "2000"):
        with make_vector_env(load_env_config("maniskill_push_cube", push + [f"init_params.render_mesh_triangles={cap}"]),
                             num_envs=1) as env:
            seen[cap] = [env.reset([3]), env.chunk_step(actions)[0]]
            triangles[cap] = robot_triangles(env)
    assert triangles["null"] > 100_000 and triangles["2000"] <= 11 * 2000  # 11 link meshes
    for full, simple in zip(seen["null"], seen["2000"]):
        np.testing.assert_array_equal(full["states"], simple["states"])
        gap = np.abs(full["main_images"].astype(int) - simple["main_images"].astype(int)).max(-1)
        assert 0 < (gap > 0).mean() and (gap > 16).mean() < 0.02
    moved = np.abs(seen["2000"][0]["main_images"].astype(int) - seen["2000"][1]["main_images"].astype(int)).max(-1)
    assert (moved > 16).mean() > 0.05


@pytest.mark.parametrize("override,message", [
    (["init_params.render_mesh_triangles=10"], r"render_mesh_triangles=10: expected null or an integer >= 100"),
    (["init_params.render_mesh_triangles=many"], r"render_mesh_triangles='many': expected null"),
    (["init_params.render_mesh_triangles=2000", "init_params.sim_backend=gpu"],
     r"render_mesh_triangles is not supported with sim_backend gpu, because"),
])
def test_a_bad_mesh_cap_is_refused_before_any_scene_is_built(override, message):
    with pytest.raises(EnvSetupError, match=message):
        make_vector_env(load_env_config("maniskill_push_cube", override), num_envs=1)


@pytest.mark.slow
def test_simulation_and_control_frequencies_and_the_shader_pack_reach_maniskill():
    """``sim_freq`` / ``control_freq`` merge into the task's sim config (an action then lasts
    sim_freq / control_freq physics steps, so the same action moves the arm further at a lower
    control rate); ``shader_pack`` shades the cameras."""
    actions = np.tile(np.array([0.5, 0.0, 0.0, 0.0], np.float32), (1, 2, 1))
    pose = ["init_params.control_mode=pd_ee_delta_pos"]
    moved = {}
    for rates in (["init_params.control_freq=20"], ["init_params.control_freq=10"]):
        with make_vector_env(load_env_config("maniskill_push_cube", pose + rates), num_envs=1) as env:
            base = env.sim.env.env.unwrapped
            env.reset([2])
            start = base.agent.tcp.pose.p.numpy().copy()
            env.chunk_step(actions)
            moved[base.control_freq] = float(np.linalg.norm(base.agent.tcp.pose.p.numpy() - start))
            assert (base.sim_freq, base._sim_steps_per_control) == (100, 100 // base.control_freq)
    assert moved[10] > moved[20] > 0
    with make_vector_env(load_env_config("maniskill_push_cube", SMALL + [
            "init_params.obs_mode=rgb", "init_params.shader_pack=default"]), num_envs=1) as env:
        default = env.reset([2])["main_images"]
        assert {c.shader_pack for c in env.sim.env.env.unwrapped._sensor_configs.values()} == {"default"}
    with make_vector_env(load_env_config("maniskill_push_cube", SMALL + ["init_params.obs_mode=rgb"]),
                         num_envs=1) as env:
        assert not np.array_equal(env.reset([2])["main_images"], default)  # minimal shades otherwise


@pytest.mark.parametrize("override,message", [
    (["init_params.sim_freq=100", "init_params.control_freq=30"], r"sim_freq=100: expected a multiple of control_freq \(30\)"),
    (["init_params.control_freq=0"], r"control_freq=0: expected null \(the task's\) or a positive integer"),
    (["init_params.shader_pack=fancy"], r"shader_pack='fancy': expected null or one of \['minimal', 'default'"),
])
def test_bad_simulation_options_are_refused_before_any_scene_is_built(override, message):
    with pytest.raises(EnvSetupError, match=message):
        make_vector_env(load_env_config("maniskill_push_cube", override), num_envs=1)
