"""Demonstrations (envs/demos.py) and their recorder (embodied/record.py): what a demo file holds
reads back as exactly what the env adapter shows the policy for the same state (same pixels,
states, instruction, actions), on the real simulators: ManiSkill's CPU simulation (lavapipe) and
LIBERO's table-top test task in ../shared/libero."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import stand_in_assets
from test_libero import BDDL, config, in_process
from envs.experts import push_cube

from core.errors import DataError
from embodied.config import build_policy, compose, load_env_config
from embodied.record import main, record, recording_env
from envs import make_vector_env
from envs.demos import check_demos, demo_view, read_demos
from envs.maniskill_demos import TrajectoryWriter

PUSH = ["init_params.control_mode=pd_ee_delta_pos", "init_params.camera_heights=48",
        "init_params.camera_widths=64", "max_episode_steps=15"]


def assert_same_obs(demo_obs: dict, env_obs: list[dict], keys: tuple[str, ...],
                    steps: list[int] | None = None) -> None:
    """The demo's step ``steps[i]`` (default: every step, in order) is the env's observation
    ``env_obs[i]`` (row 0 of a one-env batch)."""
    steps = list(range(len(demo_obs["states"]))) if steps is None else steps
    assert len(steps) == len(env_obs)
    for key in keys:
        np.testing.assert_array_equal(demo_obs[key][steps], np.stack([o[key][0] for o in env_obs]), err_msg=key)
    assert [demo_obs["task_descriptions"][t] for t in steps] == [o["task_descriptions"][0] for o in env_obs]


# ------------------------------------------------------------------------------- ManiSkill

@pytest.mark.slow
def test_maniskills_own_recordings_read_as_the_adapter_shows_them(tmp_path):
    """A file of ManiSkill's RecordEpisode (obs every step, its own layout) against the adapter
    stepped in chunks (which renders only at chunk ends): same images of both cameras, states
    (PickCube's include a boolean extra), rewards."""
    import gymnasium as gym
    from mani_skill.utils.wrappers import RecordEpisode

    from envs.maniskill import check_params
    from envs.maniskill_scene import make_kwargs

    cfg = load_env_config("maniskill_pick_cube", ["init_params.robot_uids=panda_wristcam",
                                                  "init_params.camera_heights=40", "init_params.camera_widths=56"])
    p = check_params(cfg.init_params)
    actions = np.random.default_rng(0).uniform(-1, 1, (8, 7)).astype(np.float32)
    own = RecordEpisode(gym.make(p["id"], **make_kwargs(p, 1, cfg.max_episode_steps)), str(tmp_path),
                        trajectory_name="pick", save_video=False, source_type="test")
    own.reset(seed=11)
    for action in actions:
        own.step(action)
    own.close()

    with make_vector_env(cfg, num_envs=1) as env:
        seen, rewards = [env.reset([11])], []
        for chunk in (1, 3, 3, 1):  # observations after steps 1, 4, 7 (and 8, past the demo)
            start = sum(len(r) for r in rewards)
            obs, r, *_ = env.chunk_step(actions[None, start:start + chunk])
            seen.append(obs)
            rewards.append(r[0])
    (demo,) = read_demos(tmp_path / "pick.h5", **demo_view(cfg), action_dim=7)
    assert demo.seed == 11 and demo.obs["wrist_images"].shape == (8, 40, 56, 3)
    assert_same_obs(demo.obs, seen[:4], ("main_images", "wrist_images", "states"), steps=[0, 1, 4, 7])
    assert demo.obs["main_images"].std() > 5  # a rendered scene
    assert not np.array_equal(demo.obs["main_images"][0], demo.obs["main_images"][7])  # that moved
    np.testing.assert_array_equal(demo.actions, actions)
    with h5py.File(tmp_path / "pick.h5") as f:
        np.testing.assert_allclose(np.concatenate(rewards), f["traj_0/rewards"][()], rtol=1e-6)


@pytest.mark.slow
def test_recording_keeps_the_successes_and_replays_to_the_same_pixels(tmp_path):
    """A state policy (the scripted PushCube pusher, reading the privileged state) records the
    VLA's view of an rgb+state env: of seeds 0 (solved in 15 steps) and 1 (not), only 0 is kept;
    replaying its actions in the adapter from its seed gives every recorded frame and state."""
    from mani_skill.trajectory.dataset import ManiSkillTrajectoryDataset

    from envs.maniskill import check_params
    from envs.maniskill_scene import make_kwargs
    from envs.protocol import PRIVILEGED_STATES

    env_cfg, reads_state = recording_env(load_env_config("maniskill_push_cube", PUSH), num_envs=2)
    assert reads_state and env_cfg.init_params.obs_mode == "rgb+state"
    p = check_params(env_cfg.init_params)

    def act(obs):  # chunks of 3 planned from one observation, run one step at a time
        return np.repeat(push_cube(obs[PRIVILEGED_STATES])[:, None], 3, axis=1)

    out = tmp_path / "push"
    with make_vector_env(env_cfg, num_envs=2) as env, \
            TrajectoryWriter(out, env_id=p["id"], env_kwargs=make_kwargs(p, 1, 15), max_episode_steps=15,
                             main_camera=p["main_camera"], wrist_camera=p["wrist_camera"]) as writer:
        result = record(env, act, writer, episodes=2, max_attempts=2)
    assert (result.kept, result.attempts, result.successes, result.success_rate) == (1, 2, 1, 0.5)

    found = check_demos(out.with_suffix(".h5"), **demo_view(env_cfg), action_dim=4)
    assert (found.episodes, found.image_size, found.seeds) == (1, (48, 64), (0,))
    (demo,) = read_demos(out.with_suffix(".h5"), **demo_view(env_cfg))
    (full,) = read_demos(out.with_suffix(".h5"), obs_mode="state")
    assert demo.success and demo.seed == 0 and 1 < len(demo.actions) < 15
    assert set(demo.obs) == {"main_images", "states", "task_descriptions"}
    with make_vector_env(env_cfg, num_envs=1) as env:
        seen = [env.reset([0])]
        for action in demo.actions[:-1]:
            seen.append(env.chunk_step(action[None, None])[0])
    assert_same_obs(demo.obs, seen, ("main_images", "states"))
    np.testing.assert_array_equal(full.obs["states"], np.stack([o[PRIVILEGED_STATES][0] for o in seen]))
    # ManiSkill's own loader reads the file
    assert len(ManiSkillTrajectoryDataset(str(out.with_suffix(".h5")))) == len(demo.actions)


@pytest.mark.slow
def test_dart_noise_executes_perturbed_actions_and_records_the_experts(tmp_path):
    """``--action-noise`` (DART): the env runs the pusher's actions with noise on their translation,
    the file holds the pusher's own action at every recorded state, and replaying those clean
    actions does not retrace the episode (it was not what ran)."""
    from envs.maniskill import check_params
    from envs.maniskill_scene import make_kwargs
    from envs.protocol import PRIVILEGED_STATES
    from embodied.record import translation_noise

    sample = translation_noise(0.5, seed=0)(np.zeros((2, 1, 4), np.float32))
    assert (sample[..., 3] == 0).all() and (sample[..., :3] != 0).all() and np.abs(sample).max() <= 1
    env_cfg, _ = recording_env(load_env_config("maniskill_push_cube", PUSH), num_envs=2)
    p = check_params(env_cfg.init_params)
    out = tmp_path / "dart"
    with make_vector_env(env_cfg, num_envs=2) as env, \
            TrajectoryWriter(out, env_id=p["id"], env_kwargs=make_kwargs(p, 1, 15), max_episode_steps=15,
                             main_camera=p["main_camera"], wrist_camera=p["wrist_camera"]) as writer:
        record(env, lambda obs: push_cube(obs[PRIVILEGED_STATES])[:, None], writer, episodes=2, max_attempts=2,
               keep_failures=True, perturb=translation_noise(0.5, seed=0))
    episodes = list(read_demos(out.with_suffix(".h5"), obs_mode="state"))
    assert len(episodes) == 2
    for full in episodes:
        states = full.obs["states"][:len(full.actions)]  # the state each action was chosen at
        np.testing.assert_allclose(full.actions, push_cube(states), atol=1e-6)
    full = episodes[0]
    with make_vector_env(env_cfg, num_envs=1) as env:
        seen = [env.reset([full.seed])[PRIVILEGED_STATES][0]]
        for action in full.actions[:-1]:
            seen.append(env.chunk_step(action[None, None])[0][PRIVILEGED_STATES][0])
    assert np.abs(np.stack(seen) - full.obs["states"]).max() > 1e-3


@pytest.mark.slow
def test_record_command_acts_with_the_checkpoint_it_is_given(tmp_path, capsys):
    """``python -m embodied.record`` in-process: an MLP checkpoint drives PushCube from the
    privileged state, failures kept on request; the recorded actions are the checkpoint's
    greedy actions for the recorded states (a fresh policy's would differ)."""
    from embodied import checkpoint

    overrides = [f"env.train.{o}" for o in PUSH[1:3]] + ["env.train.max_episode_steps=4"]
    cfg = compose("maniskill_ppo_mlp", overrides)
    torch.manual_seed(123)
    trained = build_policy(cfg.actor.model)
    step_dir = checkpoint.partial_dir(tmp_path / "checkpoints", 3)
    trained.save_checkpoint(step_dir / "actor")
    checkpoint.commit(tmp_path / "checkpoints", 3, {})

    out = tmp_path / "demos" / "mlp"
    code = main(["--out", str(out), "--episodes", "2", "--num-envs", "1", "--keep-failures",
                 f"runner.ckpt_path={tmp_path / 'checkpoints'}", *overrides])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and "2 episodes written to" in lines[-2]
    summary = json.loads(lines[-1])
    assert summary["episodes"] == 2 and summary["attempts"] == 2 and summary["env_steps"] == 8
    demos = list(read_demos(out.with_suffix(".h5"), obs_mode="state", action_dim=8))
    assert [d.seed for d in demos] == [0, 1]
    for demo in demos:
        with torch.no_grad():
            greedy = trained.act({"states": demo.obs["states"]}, do_sample=False).actions[:, 0].numpy()
        np.testing.assert_allclose(demo.actions, greedy, atol=1e-6)
    with torch.no_grad():
        fresh = build_policy(cfg.actor.model).act({"states": demo.obs["states"]}, do_sample=False).actions
    assert not np.allclose(demo.actions, fresh[:, 0].numpy(), atol=1e-3)


def test_record_command_refuses_envs_it_cannot_write(tmp_path, capsys):
    assert main(["--config-name", "math_grpo_tiny", "--out", str(tmp_path / "x")]) == 2
    assert "env_type='text'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- LIBERO

def write_libero_demo(path: Path, frames: list[dict], actions: np.ndarray, *, convention: str = "opengl",
                      bddl: str = str(BDDL), instruction: str | None = None) -> None:
    """A demo file in the layout of LIBERO's create_dataset.py, from robosuite observations:
    images as robosuite renders them, ee_states as position and robosuite's axis-angle."""
    from robosuite.utils.transform_utils import quat2axisangle

    from envs.libero import ensure_libero_config

    ensure_libero_config()
    from libero.libero.envs.bddl_utils import get_problem_info

    info = get_problem_info(str(BDDL))
    if instruction is not None:
        info["language_instruction"] = instruction
    turn = (lambda im: im[::-1, ::-1]) if convention == "opencv" else (lambda im: im)
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs.update(problem_info=json.dumps(info), bddl_file_name=bddl,
                          macros_image_convention=convention, env_name="LIBERO_Tabletop_Manipulation")
        demo = data.create_group("demo_0")
        obs = demo.create_group("obs")
        obs["agentview_rgb"] = np.stack([turn(r["agentview_image"]) for r in frames])
        obs["eye_in_hand_rgb"] = np.stack([turn(r["robot0_eye_in_hand_image"]) for r in frames])
        obs["ee_states"] = np.stack([np.hstack([r["robot0_eef_pos"], quat2axisangle(r["robot0_eef_quat"])])
                                     for r in frames])
        obs["gripper_states"] = np.stack([r["robot0_gripper_qpos"] for r in frames])
        obs["joint_states"] = np.stack([r["robot0_joint_pos"] for r in frames])
        demo["actions"] = actions
        demo["dones"] = np.eye(len(actions), dtype=np.uint8)[-1]


def blank_frame() -> dict:
    """A robosuite observation of 8 px black cameras and a robot at the origin."""
    return {"agentview_image": np.zeros((8, 8, 3), np.uint8), "robot0_eye_in_hand_image": np.zeros((8, 8, 3), np.uint8),
            "robot0_eef_pos": np.zeros(3), "robot0_eef_quat": np.array([0.0, 0.0, 0.0, 1.0]),
            "robot0_gripper_qpos": np.zeros(2), "robot0_joint_pos": np.zeros(7)}


@pytest.mark.slow
def test_libero_demos_read_as_the_adapter_shows_them(tmp_path):
    """LIBERO's layout, written from the real test task's raw robosuite observations, reads back
    as the adapter's observations of the same states: upright images of both cameras (also from
    a file stored in OpenCV order), the 8-d state, the instruction; the gripper action follows
    the env's convention."""
    cfg = config("init_params.wrist_camera=robot0_eye_in_hand", "init_params.camera_heights=40",
                 "init_params.num_settle_steps=0")
    actions = np.zeros((4, 7), np.float32)
    actions[:, 0], actions[:, -1] = 0.5, -1.0  # move along x, gripper open (LIBERO's -1)
    env, libero_env = in_process(cfg)
    with env:
        seen, raw = [env.reset([3])], [dict(libero_env._raw)]
        for action in actions[:-1]:
            seen.append(env.chunk_step(action[None, None])[0])
            raw.append(dict(libero_env._raw))
    for convention in ("opengl", "opencv"):
        write_libero_demo(tmp_path / f"{convention}.hdf5", raw, actions, convention=convention)
        (demo,) = read_demos(tmp_path / f"{convention}.hdf5", **demo_view(cfg), action_dim=7)
        assert_same_obs(demo.obs, seen, ("main_images", "wrist_images", "states"))
        assert demo.success and demo.seed is None
        np.testing.assert_array_equal(demo.actions, actions)
    assert not np.array_equal(raw[0]["agentview_image"], seen[0]["main_images"][0])  # it was turned
    flipped = dict(demo_view(cfg), gripper_open_action=1)
    (demo,) = read_demos(tmp_path / "opengl.hdf5", **flipped)
    np.testing.assert_array_equal(demo.actions[:, -1], -actions[:, -1])
    np.testing.assert_array_equal(demo.actions[:, :-1], actions[:, :-1])


def test_libero_suite_demos_get_the_envs_wording(tmp_path):
    """LIBERO's datasets store the BDDL's words, which for some suite tasks are not the
    benchmark's that the env gives; the reader gives the env's."""
    from envs.libero import check_config

    setup = check_config(load_env_config("libero_spatial", [
        f"init_params.assets_path={stand_in_assets(tmp_path / 'assets')}"]))
    task = setup.tasks[0]
    frame = blank_frame()
    bddl_words = "pick the akita black bowl between the plate and the ramekin and place it on the plate"
    write_libero_demo(tmp_path / "spatial.hdf5", [frame], np.zeros((1, 7), np.float32),
                      bddl=f"chiliocosm/bddl_files/libero_spatial/{task.name}.bddl", instruction=bddl_words)
    found = check_demos(tmp_path / "spatial.hdf5")
    assert found.task_description == task.description != bddl_words


# ------------------------------------------------------------------------------- bad input

def maniskill_file(folder: Path, obs_mode: str = "rgb", control_mode: str = "pd_ee_delta_pose") -> Path:
    """A valid two-step ManiSkill trajectory file of this module's writer."""
    with TrajectoryWriter(folder / "demo", env_id="PickCube-v1", max_episode_steps=50, main_camera="base_camera",
                          env_kwargs={"obs_mode": obs_mode, "control_mode": control_mode}) as writer:
        writer.add({"main_images": np.zeros((3, 16, 16, 3), np.uint8), "states": np.zeros((3, 5))},
                   np.zeros((2, 7)), np.zeros(2), np.zeros(2), np.zeros(2), np.ones(2), seed=4,
                   task_description="pick")
    return folder / "demo.h5"


def test_bad_demo_files_name_the_file_episode_and_key(tmp_path):
    good = maniskill_file(tmp_path)
    assert check_demos(good, image_size=(16, 16), action_dim=7).steps == 2
    cases = [
        (dict(action_dim=8), "traj_0/actions: has 7 dims per action; the model's action_dim is 8"),
        (dict(image_size=(32, 32)), "traj_0/obs/sensor_data/base_camera/rgb: images are 16x16"),
        (dict(main_camera="front"),
         r"traj_0/obs/sensor_data/front/rgb: missing \(traj_0/obs/sensor_data holds \['base_camera'\]\)"),
        (dict(control_mode="pd_joint_delta_pos"), r"episodes\[0\].control_mode='pd_ee_delta_pose'"),
    ]
    for view, message in cases:
        with pytest.raises(DataError, match=message):
            check_demos(good, **view)
        with pytest.raises(DataError, match=re.escape(str(good.with_suffix("")))):  # .h5 or .json
            next(read_demos(good, **view))

    privileged = maniskill_file(tmp_path / "priv", obs_mode="rgb+state")
    with pytest.raises(DataError, match="obs_mode='rgb\\+state': its observations hold the privileged state"):
        check_demos(privileged)
    with h5py.File(good, "a") as f:
        del f["traj_0/obs/states"]
    with pytest.raises(DataError, match=r"traj_0/obs/agent: missing"):
        check_demos(good)
    good.with_suffix(".json").unlink()
    with pytest.raises(DataError, match="demo.json: missing"):
        check_demos(good)

    (tmp_path / "notes.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="notes.h5: not an HDF5 file"):
        check_demos(tmp_path / "notes.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.create_group("episodes")
    with pytest.raises(DataError, match="neither ManiSkill's trajectory layout .* nor LIBERO's"):
        check_demos(tmp_path / "other.h5")
    with h5py.File(tmp_path / "empty.hdf5", "w") as f:
        f.create_group("data")
    with pytest.raises(DataError, match=r"empty.hdf5: data/demo_<i>: no episodes"):
        list(read_demos(tmp_path / "empty.hdf5"))
    with pytest.raises(DataError, match="no such demo file"):
        check_demos(tmp_path / "absent.h5")


def test_bad_libero_demos_name_the_key(tmp_path):
    frame = blank_frame()
    path = tmp_path / "demo.hdf5"
    write_libero_demo(path, [frame, frame], np.zeros((2, 7), np.float32))
    with h5py.File(path, "a") as f:
        del f["data/demo_0/obs/eye_in_hand_rgb"]
        del f["data/demo_0/obs/gripper_states"]
        f["data/demo_0/obs/gripper_states"] = np.zeros((1, 2))
    with pytest.raises(DataError, match=r"demo.hdf5: data/demo_0/obs/eye_in_hand_rgb: missing"):
        check_demos(path, wrist_camera="robot0_eye_in_hand")
    with pytest.raises(DataError, match=r"data/demo_0/obs/gripper_states: has shape \[1, 2\], expected 2 rows"):
        check_demos(path)
    # a file whose task cannot be named, or whose actions are not the model's
    write_libero_demo(path, [frame, frame], np.zeros((2, 7), np.float32), bddl="/nonexistent/task.bddl")
    with h5py.File(path, "a") as f:
        del f["data"].attrs["problem_info"]
    with pytest.raises(DataError, match=r"demo.hdf5: data.attrs: no instruction: neither problem_info nor a "
                                        r"bddl_file_name that exists \('/nonexistent/task.bddl'\)"):
        list(read_demos(path))
    write_libero_demo(path, [frame, frame], np.zeros((2, 6), np.float32))
    with pytest.raises(DataError, match=r"data/demo_0/actions: has 6 dims per action; the model's action_dim is 7"):
        check_demos(path, action_dim=7)



def test_record_command_refuses_attempts_past_a_finite_set_of_reset_states(tmp_path, capsys):
    """LIBERO's init states are a finite set (here 2): attempts that would reset past it are
    refused before any episode runs, naming the options; nothing is written."""
    from test_libero import DATA

    split = ["task_suite_name=null", f"init_params.bddl_files=[{BDDL}]", "init_params.init_state_range=[0,2]",
             f"init_params.assets_path={DATA / 'assets'}", "init_params.privileged_states=true",
             "init_params.camera_heights=32", "init_params.camera_widths=32", "max_episode_steps=4"]
    out = tmp_path / "demos"
    code = main(["--config-name", "libero_spatial_ppo_openvla_oft", "--expert", "libero_pick_place", "--out", str(out),
                 "--episodes", "2", "--max-attempts", "2", "--first-reset-state", "1", "--num-envs", "1",
                 *[f"env.train.{o}" for o in split]])
    assert code == 2
    assert "--first-reset-state 1 + --max-attempts (default 4 x --episodes) reach reset state 2; the env has 2" \
        in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
