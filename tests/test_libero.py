"""LIBERO behind the vector-env interface, on the real simulator: the table-top test task and
asset subset in ../shared/libero (or $LIBERO_TEST_DATA), small cameras and few steps (rendering
is most of a step here). The suites' structure (tasks, init states, limits) is checked here from
the libero package; their scenes are built in tests/test_libero_suites.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import imageio
import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from conftest import stand_in_assets
from envs.libero import SUITE_MAX_STEPS, LiberoEnv, check_config
from embodied.config import load_env_config
from envs import make_vector_env
from envs.vector_env import EnvSetupError
from tests.runs import ONE_RANK_EACH, embodied

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LIBERO_TEST_DATA", ROOT.parent / "shared" / "libero"))
BDDL = DATA / "bddl" / "put_the_alphabet_soup_in_the_frying_pan.bddl"
SOUP = "put the alphabet soup in the frying pan"
KETCHUP = "put the ketchup in the frying pan"


@pytest.fixture(scope="module", autouse=True)
def test_data():
    if not BDDL.is_file():
        pytest.fail(f"LIBERO test data missing: {BDDL}; set LIBERO_TEST_DATA to the folder "
                    "holding bddl/ and assets/ (../shared/libero beside the repository)")


def ketchup_task(folder: Path) -> Path:
    """A second real task on the same scene (ketchup instead of soup), for task switching."""
    text = BDDL.read_text().replace(SOUP, KETCHUP).replace("(On alphabet_soup_1 chefmate",
                                                         "(On ketchup_1 chefmate")
    path = folder / "put_the_ketchup_in_the_frying_pan.bddl"
    path.write_text(text)
    return path


def config(*overrides: str, files: list[Path] | None = None):
    files = files or [BDDL]
    return load_env_config("libero_base", [
        "task_suite_name=null", f"init_params.bddl_files=[{','.join(map(str, files))}]",
        "init_params.init_state_range=[0,50]", f"init_params.assets_path={DATA / 'assets'}",
        "init_params.camera_heights=32", "init_params.camera_widths=32",
        "init_params.wrist_camera=null", "max_episode_steps=6", *overrides])


def in_process(cfg):
    """A one-env vector env (steps in this process), and its LIBERO env."""
    env = make_vector_env(cfg, num_envs=1)
    return env, env.sim.env


def place_soup_on_pan(libero_env: LiberoEnv) -> None:
    """Move the soup can 5 cm above the pan's centre; it then falls onto the pan."""
    sim = libero_env.env.sim
    pan = sim.data.get_joint_qpos("chefmate_8_frypan_1_joint0")
    soup = sim.data.get_joint_qpos("alphabet_soup_1_joint0").copy()
    soup[:3] = pan[:3] + [0.0, 0.0, 0.05]
    sim.data.set_joint_qpos("alphabet_soup_1_joint0", soup)
    sim.forward()


@pytest.mark.slow
def test_observations_as_openvla_oft_expects_them():
    cfg = config("init_params.wrist_camera=robot0_eye_in_hand", "init_params.camera_heights=40")
    env, libero_env = in_process(cfg)
    with env:
        obs = env.reset([3])
        assert obs["main_images"].shape == (1, 40, 32, 3) and obs["main_images"].dtype == np.uint8
        assert obs["wrist_images"].shape == (1, 40, 32, 3)
        assert obs["states"].shape == (1, 8) and obs["states"].dtype == np.float32
        assert obs["task_descriptions"] == [SOUP]
        raw = libero_env._raw
        # upright: the renders turned by 180 degrees (rows and columns reversed)
        np.testing.assert_array_equal(obs["main_images"][0], np.rot90(raw["agentview_image"], 2))
        np.testing.assert_array_equal(obs["wrist_images"][0],
                                      np.rot90(raw["robot0_eye_in_hand_image"], 2))
        assert obs["main_images"].std() > 10  # a rendered scene, not a blank frame
        # end-effector position (the grip site), orientation (the hand's) as an axis-angle whose
        # rotation scipy agrees with, and the two finger joints
        robosuite_env = libero_env.env.env
        sim, robot = robosuite_env.sim, robosuite_env.robots[0]
        np.testing.assert_allclose(obs["states"][0, :3], sim.data.site_xpos[robot.eef_site_id],
                                   atol=1e-5)
        w, x, y, z = sim.data.get_body_xquat(robot.robot_model.eef_name)
        np.testing.assert_allclose(Rotation.from_rotvec(obs["states"][0, 3:6]).as_matrix(),
                                   Rotation.from_quat([x, y, z, w]).as_matrix(), atol=1e-5)
        fingers = [sim.data.get_joint_qpos(j) for j in robosuite_env.robots[0].gripper.joints]
        np.testing.assert_allclose(obs["states"][0, 6:], fingers, atol=1e-6)


@pytest.mark.slow
def test_settle_steps_run_before_the_first_observation():
    settled, settled_env = in_process(config())
    raw, raw_env = in_process(config("init_params.num_settle_steps=0"))
    with settled, raw:
        a, b = settled.reset([5]), raw.reset([5])
        assert settled_env.env.env.timestep == 10 and raw_env.env.env.timestep == 0
        # same init state; the settle steps let the objects come to rest, unseen by the policy
        assert not np.array_equal(a["main_images"], b["main_images"])
        _, _, _, _, infos = settled.chunk_step(np.zeros((1, 2, 7), np.float32))
        assert infos["episode_length"][0] == 2 and settled_env.env.env.timestep == 12


@pytest.mark.slow
def test_settle_steps_hold_the_gripper_open_or_command_nothing():
    """``reset_gripper_open`` (RLinf's name): the settle steps command the gripper open, or send
    it a 0 command, which moves the fingers elsewhere from the same init state."""
    opened, _ = in_process(config("init_params.num_settle_steps=8"))
    zero, _ = in_process(config("init_params.num_settle_steps=8", "init_params.reset_gripper_open=false"))
    with opened, zero:
        a, b = opened.reset([4])["states"][0, 6:], zero.reset([4])["states"][0, 6:]
        assert abs(a[0]) > 0.035  # open, about +-0.04
        assert abs(abs(a[0]) - abs(b[0])) > 0.003


@pytest.mark.slow
def test_soup_on_the_pan_succeeds_and_terminates_in_the_chunks_last_slot():
    cfg = config("max_episode_steps=40")
    env, libero_env = in_process(cfg)
    with env:
        env.reset([0])
        _, rewards, terms, truncs, infos = env.chunk_step(np.zeros((1, 3, 7), np.float32))
        assert not infos["success_once"][0] and not rewards.any()  # the untouched scene
        place_soup_on_pan(libero_env)
        actions = np.zeros((1, 30, 7), np.float32)
        actions[..., -1] = -1  # gripper open
        _, rewards, terms, truncs, infos = env.chunk_step(actions)
        length = int(infos["episode_length"][0])
        assert infos["done"][0] and infos["success"][0] and terms[0, -1] and not truncs.any()
        assert not terms[0, :-1].any() and 3 < length < 33
        assert rewards[0, length - 4] == 1.0 and rewards.sum() == 1.0  # reward 1 on success
        assert infos["episode_return"][0] == 1.0


@pytest.mark.slow
def test_gripper_open_action_flips_the_sign_the_simulator_sees():
    own, own_env = in_process(config("init_params.num_settle_steps=0"))
    flipped, flipped_env = in_process(config("init_params.num_settle_steps=0",
                                             "init_params.gripper_open_action=1"))
    with own, flipped:
        own.reset([1]), flipped.reset([1])
        close = np.zeros((1, 8, 7), np.float32)
        close[..., -1] = 1.0  # closes with LIBERO's convention, opens with the flipped one
        a = own.chunk_step(close)[0]["states"][0, 6:]
        b = flipped.chunk_step(close)[0]["states"][0, 6:]
        start = 0.04  # finger joints of the open gripper, about +-0.04
        assert abs(a[0]) < start - 0.005  # closing
        assert abs(b[0]) > start - 0.002  # stays open


@pytest.mark.slow
def test_groups_auto_reset_and_task_switching_in_env_processes(tmp_path):
    files = [BDDL, ketchup_task(tmp_path)]
    cfg = config("auto_reset=true", "use_fixed_reset_state_ids=true", "group_size=2",
                 "max_episode_steps=4", "init_params.init_state_range=[0,4]", "total_num_envs=4",
                 files=files)
    with make_vector_env(cfg, num_envs=4) as env:
        assert env.sim.num_reset_states == 8  # 2 tasks x 4 init states
        # ids 1 and 6: soup task init 1, ketchup task init 2
        obs = env.reset([1, 1, 6, 6])
        assert obs["task_descriptions"] == [SOUP, SOUP, KETCHUP, KETCHUP]
        assert env.reset_state_names[2] == "task001_init02_put_the_ketchup_in_the_frying_pan"
        np.testing.assert_array_equal(obs["main_images"][0], obs["main_images"][1])
        np.testing.assert_array_equal(obs["states"][0], obs["states"][1])
        assert not np.array_equal(obs["main_images"][0], obs["main_images"][2])
        first = obs
        seen = []
        for _ in range(4):  # 2-step chunks, 4-step episodes: a reset every second chunk
            obs, rewards, terms, truncs, infos = env.chunk_step(np.zeros((4, 2, 7), np.float32))
            if infos["done"].any():
                assert infos["done"].all() and truncs[:, -1].all()
                np.testing.assert_array_equal(infos["final_obs"]["task_descriptions"],
                                              seen[-1] if seen else first["task_descriptions"])
                assert infos["extra_episode"].tolist() == [False] * 4
                # a group still shares its new (drawn) state; tasks follow the reset ids
                np.testing.assert_array_equal(obs["states"][0], obs["states"][1])
                np.testing.assert_array_equal(obs["main_images"][2], obs["main_images"][3])
                names = env.reset_state_names
                assert names[0] == names[1] and names[2] == names[3]
                expected = [SOUP if n.startswith("task000") else KETCHUP for n in names]
                assert obs["task_descriptions"] == expected
                seen.append(obs["task_descriptions"])
        assert len(seen) == 2


@pytest.mark.slow
def test_task_switch_rebuilds_only_when_the_task_changes(tmp_path):
    cfg = config("init_params.init_state_range=[0,2]", "init_params.num_settle_steps=0",
                 files=[BDDL, ketchup_task(tmp_path)])
    env, libero_env = in_process(cfg)
    with env:
        env.reset([0])
        built = libero_env.env
        env.reset([1])  # same task, another init state: the scene is kept
        assert libero_env.env is built and env.task_descriptions == [SOUP]
        obs = env.reset([2])  # the ketchup task
        assert libero_env.env is not built and obs["task_descriptions"] == [KETCHUP]
        assert libero_env.env.language_instruction.strip() == KETCHUP


@pytest.mark.slow
def test_an_episode_does_not_depend_on_the_one_before():
    """Scenes are reset softly (not rebuilt from XML): an env that has run another episode, with
    the gripper closing, starts an init state exactly as a freshly built one does."""
    cfg = config("init_params.num_settle_steps=3")
    with make_vector_env(cfg, num_envs=2) as env:
        actions = np.zeros((2, 3, 7), np.float32)
        actions[1, :, 0], actions[1, :, -1] = 0.5, 1.0  # env 1 moves and closes its gripper
        env.reset([8, 9])
        env.chunk_step(actions)
        a = env.reset([7, 7])  # env 0 built fresh for this task... both now start init state 7
        np.testing.assert_array_equal(a["states"][0], a["states"][1])
        np.testing.assert_array_equal(a["main_images"][0], a["main_images"][1])
        same = np.zeros((2, 3, 7), np.float32)
        same[:, :, 1] = 0.3
        b = env.chunk_step(same)[0]
        np.testing.assert_array_equal(b["states"][0], b["states"][1])
        np.testing.assert_array_equal(b["main_images"][0], b["main_images"][1])
        c = env.reset([7, 8])
        assert not np.array_equal(c["main_images"][0], c["main_images"][1])


@pytest.mark.slow
def test_per_episode_videos_are_named_by_task_and_init_state(tmp_path):
    videos = tmp_path / "videos"
    cfg = config("video_cfg.save_video=true", "video_cfg.per_episode=true",
                 f"video_cfg.video_base_dir={videos}", "init_params.wrist_camera=robot0_eye_in_hand",
                 "max_episode_steps=4")
    with make_vector_env(cfg, num_envs=2, name="eval_rank0_stage0") as env:
        env.reset([12, 31])
        for _ in range(2):
            env.chunk_step(np.zeros((2, 2, 7), np.float32))
    files = sorted(p.name for p in videos.iterdir())
    task = "put_the_alphabet_soup_in_the_frying_pan"
    assert files == [f"eval_rank0_stage0_task000_init12_{task}_0000.mp4",
                     f"eval_rank0_stage0_task000_init31_{task}_0001.mp4"]
    frames = np.stack(imageio.mimread(videos / files[0], memtest=False))
    # the reset and 2 chunks x 2 steps; agent view and wrist view side by side (32 px, padded to 16s)
    assert frames.shape == (5, 32, 64, 3) and frames.std() > 5


# ------------------------------------------------------------------ suites and configs

@pytest.mark.parametrize("suite,tasks", [("libero_spatial", 10), ("libero_object", 10),
                                         ("libero_goal", 10), ("libero_10", 10),
                                         ("libero_90", 90), ("libero_130", 130)])
def test_suites_tasks_init_states_and_limits(suite, tasks, tmp_path):
    assets = stand_in_assets(tmp_path / "assets")
    cfg = load_env_config(suite, [f"init_params.assets_path={assets}"])
    setup = check_config(cfg)
    assert len(setup.tasks) == tasks and setup.num_states == 50
    assert setup.num_reset_states == tasks * 50
    assert cfg.max_episode_steps == SUITE_MAX_STEPS.get(suite, 520)
    assert all(t.init_states.shape[0] >= 50 and Path(t.bddl_file).is_file() for t in setup.tasks)
    assert all(t.description and t.description == t.description.strip() for t in setup.tasks)
    names = setup.reset_state_names()
    assert len(set(names)) == tasks * 50 and names[51].startswith(f"{suite}/task001_init01_")


def test_held_out_init_states_are_disjoint_and_reported(tmp_path):
    from omegaconf import OmegaConf

    from embodied.runner import shared_reset_states

    assets = stand_in_assets(tmp_path / "assets")
    common = [f"init_params.assets_path={assets}"]
    train = load_env_config("libero_spatial", common + ["init_params.init_state_range=[0,40]"])
    held_out = load_env_config("libero_spatial", common + ["init_params.init_state_range=[40,50]"])
    every = load_env_config("libero_spatial", common)
    split = check_config(held_out)
    assert split.num_reset_states == 100 and split.task_and_state(13) == (1, 43)
    cfg = OmegaConf.create({"env": {"train": train, "eval": held_out}})
    assert shared_reset_states(cfg) == 0
    cfg = OmegaConf.create({"env": {"train": train, "eval": every}})
    assert shared_reset_states(cfg) == 400


@pytest.mark.parametrize("overrides,message", [
    (["task_suite_name=libero_spatal"], "env.task_suite_name='libero_spatal': expected one of"),
    (["task_suite_name=libero_goal", "init_params.task_ids=[3,10]"], "env.init_params.task_ids=[3, 10]"),
    (["init_params.camera_heights=0"], "env.init_params.camera_heights=0: expected a positive integer"),
    (["init_params.init_state_range=[45,51]"], "env.init_params.init_state_range=[45, 51]"),
    (["init_params.gripper_open_action=0"], "env.init_params.gripper_open_action=0"),
    (["init_params.reset_gripper_open=1"], "env.init_params.reset_gripper_open=1: expected true or false"),
    (["init_params.assets_path=/nonexistent/libero_assets"],
     "LIBERO assets: /nonexistent/libero_assets does not exist. Install them from the package registry"),
    (["+init_params.camera=1"], "env.init_params: unknown keys ['camera']"),
])
def test_bad_env_configs_name_the_key(overrides, message, tmp_path):
    assets = stand_in_assets(tmp_path / "assets")
    cfg = load_env_config("libero_spatial", [f"init_params.assets_path={assets}", *overrides])
    with pytest.raises(EnvSetupError) as err:
        check_config(cfg)
    assert message in str(err.value)


def test_bad_bddl_files_and_missing_assets_name_the_file(tmp_path):
    broken = tmp_path / "broken.bddl"
    broken.write_text("(define (problem LIBERO_Tabletop_Manipulation)\n  (:domain robosuite)\n")
    with pytest.raises(EnvSetupError, match=f"{broken} is not a LIBERO BDDL task"):
        check_config(config(files=[broken]))
    with pytest.raises(EnvSetupError, match="does not exist"):
        check_config(config(files=[tmp_path / "absent.bddl"]))
    (tmp_path / "assets" / "scenes").mkdir(parents=True)
    with pytest.raises(EnvSetupError, match=f"{tmp_path / 'assets'} lacks textures"):
        check_config(config(f"init_params.assets_path={tmp_path / 'assets'}"))


@pytest.mark.parametrize("command,name,envs,steps,chunks", [
    ("train", "libero_spatial_ppo_openvla_oft", 32, 220, 28),
    ("train", "libero_10_grpo_openvla_oft", 64, 520, 65),
    ("eval", "libero_spatial_eval_openvla_oft", 32, 220, 28),
])
@pytest.mark.slow
def test_openvla_oft_configs_dry_run(command, name, envs, steps, chunks, tmp_path, monkeypatch):
    (tmp_path / "trainer_state.json").write_text("{}")
    monkeypatch.setenv("LIBERO_ASSETS_PATH", str(stand_in_assets(tmp_path / "assets")))
    _, done = embodied(command, ["--config-name", name, "--dry-run", f"runner.ckpt_path={tmp_path}"])
    suite = name.split("_")[0] + "_" + name.split("_")[1]
    assert f"env.eval: libero {suite}, {envs} envs, {steps} steps/episode" in done.stdout
    assert f"rollout: {chunks} chunk steps of 8 action(s)" in done.stdout


@pytest.mark.slow
def test_bad_libero_config_exits_2_before_workers_start(tmp_path, monkeypatch):
    monkeypatch.setenv("LIBERO_ASSETS_PATH", str(stand_in_assets(tmp_path / "assets")))
    spatial = ["--config-name", "libero_spatial_ppo_openvla_oft", "--dry-run"]
    _, done = embodied("train", [*spatial, "env.train.init_params.task_ids=[12]"], code=2)
    assert "env.train: env.init_params.task_ids=[12]: expected distinct task indices in [0, 10)" in done.stderr
    _, done = embodied("train", [*spatial, "env.eval.init_params.assets_path=/nonexistent"], code=2)
    assert "env.eval: LIBERO assets: /nonexistent does not exist" in done.stderr
    _, done = embodied("train", [*spatial, "env.eval.auto_reset=true"], code=2)
    assert "env.eval.auto_reset = True: expected false" in done.stderr
    # the policy's gripper convention must be the env's
    _, done = embodied("train", [*spatial, "actor.model.invert_gripper=false"], code=2)
    assert ("env.train.init_params.gripper_open_action = -1: expected 1 with "
            "actor.model.invert_gripper=False") in done.stderr
    embodied("train", [*spatial, "actor.model.invert_gripper=false", "env.train.init_params.gripper_open_action=1",
                       "env.eval.init_params.gripper_open_action=1"])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_eval_runs_every_task_and_init_state_once_with_named_videos(tmp_path):
    """embodied-train for one step, then embodied-eval with each_reset_state_once: 2 tasks x 3
    held-out init states = 6 episodes on 4 envs (2 env workers), so 2 rounds with 2 extra
    episodes that count nowhere; per-task counts, the overlap report and one video per episode."""
    files = ",".join(map(str, [BDDL, ketchup_task(tmp_path)]))
    env = [f"init_params.bddl_files=[{files}]", f"init_params.assets_path={DATA / 'assets'}",
           "task_suite_name=null", "init_params.camera_heights=32", "init_params.camera_widths=32",
           "init_params.wrist_camera=null", "init_params.num_settle_steps=2", "max_episode_steps=4"]
    configs = tmp_path / "config"  # the project's configs plus an MLP-on-LIBERO experiment
    configs.mkdir()
    for name in ("base.yaml", "env", "model"):
        (configs / name).symlink_to(ROOT / "config" / name)
    (configs / "libero_mlp.yaml").write_text((ROOT / "config" / "maniskill_ppo_mlp.yaml").read_text()
                                             .replace("env/maniskill_push_cube@", "env/libero_base@"))
    args = ["--config-path", str(configs), "--config-name", "libero_mlp",
            *[f"env.train.{o}" for o in env], *[f"env.eval.{o}" for o in env],
            "env.train.init_params.init_state_range=[0,3]", "env.eval.init_params.init_state_range=[3,6]",
            "env.train.total_num_envs=2", "env.train.auto_reset=false", "env.eval.total_num_envs=4",
            "env.eval.each_reset_state_once=true", "env.eval.use_fixed_reset_state_ids=false",
            "actor.model.state_dim=8", "actor.model.action_dim=7", "actor.model.num_action_chunks=2",
            "actor.global_batch_size=4", "actor.micro_batch_size=4", "algorithm.update_epochs=1",
            f"runner.output_dir={tmp_path}", "runner.experiment_name=libero", "runner.max_epochs=1",
            "runner.val_check_interval=-1"]
    embodied("train", [*args, *ONE_RANK_EACH])  # the eval below is the one on 2 env workers
    videos = tmp_path / "videos"
    result, done = embodied("eval", [*args, f"runner.ckpt_path={tmp_path / 'libero' / 'checkpoints'}",
                                     "env.eval.video_cfg.save_video=true", "env.eval.video_cfg.per_episode=true",
                                     f"env.eval.video_cfg.video_base_dir={videos}"])
    soup, ketchup = (t.replace(" ", "_") for t in (SOUP, KETCHUP))
    assert result["episodes"] == 6 and result["reset_states_shared_with_train"] == 0
    assert {t: v["episodes"] for t, v in result["tasks"].items()} == {soup: 3, ketchup: 3}
    assert f"  {soup}: success 0.000 over 3 episodes" in done.stdout.splitlines()
    assert "  train and eval reset states are disjoint" in done.stdout.splitlines()
    # one file per episode, by task and init state: every (task, init state 3..5) exactly once
    names = sorted(p.name.split("_stage0_")[1][:14] for p in videos.iterdir())
    assert names == sorted(f"task{t:03d}_init{k:02d}" for t in (0, 1) for k in (3, 4, 5))
    frames = np.stack(imageio.mimread(next(videos.iterdir()), memtest=False))
    assert frames.shape == (5, 32, 32, 3)  # the reset and one frame per step of two 2-step chunks
    # the eval report names every episode by task and init state, failures first
    page = Path(result["report"]).read_text()
    assert page.count("<figure class='fail'>") == 6
    captions = re.findall(r"<br>(task\d{3}_init\d{2})_\w+, 4 steps<br>", page)
    assert sorted(captions) == sorted(f"task{t:03d}_init{k:02d}" for t in (0, 1) for k in (3, 4, 5))


@pytest.mark.slow
def test_soft_resets_match_liberos_own_hard_reset():
    """Our scenes are reset softly (0.04 s instead of 1.2 s to rebuild from XML); after another
    episode, the same init state and actions give exactly the states of LIBERO's own env built
    fresh with its default hard reset."""
    from libero.libero.envs import OffScreenRenderEnv

    env, libero_env = in_process(config())
    with env:
        moves = np.zeros((1, 5, 7), np.float32)
        moves[..., 0], moves[..., -1] = 0.5, 1.0  # move and close the gripper
        env.reset([3])
        env.chunk_step(moves)
        env.reset([7])
        hard = OffScreenRenderEnv(bddl_file_name=str(BDDL), camera_names=["agentview"],
                                  camera_heights=32, camera_widths=32)
        try:
            hard.seed(7)
            hard.reset()
            for _ in range(10):  # the settle steps
                hard.step([0, 0, 0, 0, 0, 0, -1])
            np.testing.assert_array_equal(hard.get_sim_state(), libero_env.env.get_sim_state())
            actions = np.zeros((1, 6, 7), np.float32)
            actions[..., 1], actions[..., -1] = 0.3, 1.0
            env.chunk_step(actions)
            for a in actions[0]:
                hard.step(a)
            np.testing.assert_array_equal(hard.get_sim_state(), libero_env.env.get_sim_state())
        finally:
            hard.close()
