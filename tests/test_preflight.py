"""Issue 21: a checkpoint carries its run, and every mistake that can be seen before workers start
stops the command there, with exit code 2 and one line naming the key and the file.

Each case runs the command's own entry point in this process (``embodied.cli``) on real tiny
OpenVLA-OFT checkpoints: training checkpoints are written as ``Runner.save`` writes them (the
policy's ``save_checkpoint`` under ``actor/``, then ``checkpoint.commit`` with the resolved
config). No Ray cluster is started: each case takes seconds, where a worker found the same
mistakes 35-130 s in."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from embodied import checkpoint, cli
from embodied.config import build_policy, load_env_config
from envs import describe
from policies import POLICIES
from policies.openvla_oft.tiny import norm_stats, tiny_config, write_tiny_checkpoint
from tests.conftest import stand_in_assets

SECONDS = 30  # a case's limit: workers alone take longer to start here
EVAL = "maniskill_eval_openvla_oft"  # L1 head, proprio, two images: the released-checkpoint eval config
PPO = "maniskill_ppo_openvla_oft"  # discrete head, LoRA, value head


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A discrete-head checkpoint folder (the base of the training runs below)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", num_shards=1)


@pytest.fixture(scope="module")
def tiny_l1(tmp_path_factory) -> Path:
    """The official OFT layout for PickCube with the wrist camera robot: L1 head, proprio
    projector for its 29 state dimensions."""
    config = tiny_config(stats=norm_stats(proprio_dim=29))
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_l1") / "tiny_l1", config=config, proprio_dim=29,
                                 l1_head=True, num_shards=1)


def write_run(root: Path, config_name: str, overrides: list[str], with_config: bool = True) -> Path:
    """A training run's checkpoint folder as the runner writes it; ``with_config`` false: as
    written before checkpoints carried their config."""
    cfg, _ = cli.load(config_name, overrides)
    policy = build_policy(cfg.actor.model)
    policy.save_checkpoint(checkpoint.partial_dir(root, 1) / checkpoint.ACTOR_DIR)
    checkpoint.commit(root, 1, {"env_steps": 0, "next_episodes": {}},
                      config=OmegaConf.to_yaml(cfg) if with_config else None)
    return root


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny) -> Path:
    """``maniskill_ppo_openvla_oft``'s checkpoints: LoRA adapter and value head."""
    return write_run(tmp_path_factory.mktemp("lora_run") / "checkpoints", PPO,
                     [f"actor.model.model_path={tiny}", "actor.model.unnorm_key=tiny_dataset"])


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny) -> Path:
    """A full fine-tuning GRPO run: a checkpoint folder under actor/model, no value head."""
    return write_run(tmp_path_factory.mktemp("full_run") / "checkpoints", "maniskill_grpo_openvla_oft",
                     [f"actor.model.model_path={tiny}", "actor.model.unnorm_key=tiny_dataset",
                      "actor.model.is_lora=false"])


def without_config(run: Path, old: Path) -> Path:
    """A copy of ``run`` as checkpoints were written before they carried their config (and the
    sizes of their files)."""
    shutil.copytree(run, old)
    step = checkpoint.latest(old)
    (step / checkpoint.CONFIG_FILE).unlink()
    state = checkpoint.read_trainer_state(step)
    del state["files"]
    (step / checkpoint.TRAINER_STATE).write_text(json.dumps(state))
    return old


@pytest.fixture(scope="module")
def old_lora_run(tmp_path_factory, lora_run) -> Path:
    return without_config(lora_run, tmp_path_factory.mktemp("old_lora") / "checkpoints")


@pytest.fixture(scope="module")
def old_full_run(tmp_path_factory, full_run) -> Path:
    return without_config(full_run, tmp_path_factory.mktemp("old_full") / "checkpoints")


def run(command: str, args: list[str], capsys) -> tuple[int, str, str, float, bool]:
    """``embodied-<command> args`` in this process: exit code, stdout, stderr, seconds, and
    whether it built a cluster (joined or started Ray)."""
    from embodied import cluster

    built = []
    real = cluster.Cluster.__init__

    def noted(self, *args, **kwargs):
        built.append(True)
        real(self, *args, **kwargs)

    tic = time.monotonic()
    cluster.Cluster.__init__ = noted
    try:
        with pytest.raises(SystemExit) as done:
            {"eval": cli.evaluate, "export": cli.export, "train": cli.train}[command](args)
    finally:
        cluster.Cluster.__init__ = real
    out, err = capsys.readouterr()
    return done.value.code, out, err, time.monotonic() - tic, bool(built)


def refused(command: str, args: list[str], capsys, *named: str) -> str:
    """The command exits 2 within seconds, before any worker, with one line naming ``named``."""
    code, _, err, seconds, started = run(command, args, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"embodied-{command}: config error: "), err
    for text in named:
        assert text in err, f"{text!r} not in {err}"
    assert seconds < SECONDS and not started
    return err


# ---------------------------------------------------------------- a checkpoint carries its run
def test_every_checkpoint_stores_its_resolved_config(lora_run):
    stored = checkpoint.read_config(checkpoint.latest(lora_run))
    model = stored["actor"]["model"]
    assert (model["is_lora"], model["add_value_head"], model["action_head"], model["max_prompt_length"]) == (
        True, True, "discrete", 30)
    assert "${" not in (checkpoint.latest(lora_run) / checkpoint.CONFIG_FILE).read_text()  # resolved


def test_eval_takes_the_model_settings_from_the_checkpoint(lora_run, tiny, capsys):
    """The eval config of released checkpoints (L1 head, proprio, two images, no LoRA) on a LoRA
    PPO run: only the checkpoint path is given, the rest comes from the checkpoint."""
    code, out, err, _, _ = run("eval", ["--config-name", EVAL, f"runner.ckpt_path={lora_run}", "--dry-run"], capsys)
    assert code == 0, err
    assert f"model settings from {checkpoint.latest(lora_run) / 'config.yaml'}" in out
    cfg, notes = cli.prepare(EVAL, ["runner.only_eval=true", f"runner.ckpt_path={lora_run}"])
    model = cfg.actor.model
    assert (model.model_path, model.is_lora, model.add_value_head, model.action_head, model.use_proprio,
            model.num_images_in_input, model.unnorm_key) == (
        str(tiny), True, True, "discrete", False, 1, "tiny_dataset")
    assert model.lora_path == str(checkpoint.latest(lora_run) / "actor" / "lora_adapter")  # the run's own adapter
    assert cfg.env.eval.init_params.robot_uids == "panda_wristcam"  # the env stays the config's


def test_without_config_name_the_checkpoint_config_is_the_config(lora_run, tiny, capsys):
    code, out, err, _, _ = run("eval", [f"runner.ckpt_path={lora_run}", "--dry-run"], capsys)
    assert code == 0, err
    assert f"model: openvla_oft from {tiny}, LoRA rank 32" in out and "experiment: maniskill_ppo_openvla_oft" in out


def test_export_needs_only_the_checkpoint(lora_run, tmp_path, capsys):
    code, out, err, _, _ = run("export", [f"runner.ckpt_path={lora_run}", "--out", str(tmp_path / "exported")], capsys)
    assert code == 0, err
    exported = sorted(p.name for p in (tmp_path / "exported").iterdir())
    assert "rl_heads.safetensors" in exported and "lora_adapter" not in exported  # merged, value head kept


@pytest.mark.parametrize("override,key,trained", [
    ("actor.model.is_lora=false", "actor.model.is_lora = False", "actor.model.is_lora = True"),
    ("actor.model.add_value_head=false", "actor.model.add_value_head = False", "actor.model.add_value_head = True"),
    ("actor.model.use_proprio=true", "actor.model.use_proprio = True", "actor.model.use_proprio = False"),
])
def test_an_override_that_contradicts_the_checkpoint_names_both_values(override, key, trained, lora_run, capsys):
    refused("eval", ["--config-name", EVAL, f"runner.ckpt_path={lora_run}", override, "--dry-run"], capsys,
            key, trained, "config.yaml", "runner.ckpt_path")


def test_the_prompt_length_is_the_checkpoints_unless_the_command_line_sets_it(lora_run):
    """Positions count real tokens only, so a longer prompt (a new env's instructions) changes
    nothing the weights learned; a too short one is refused by the env's check."""
    args = ["runner.only_eval=true", f"runner.ckpt_path={lora_run}"]
    longer = "libero_10_grpo_openvla_oft"  # its file says 40
    assert cli.prepare(longer, args)[0].actor.model.max_prompt_length == 30
    assert cli.prepare(longer, [*args, "runner.max_prompt_length=48"])[0].actor.model.max_prompt_length == 48
    cfg, _ = cli.load(EVAL, [*args, "runner.max_prompt_length=40"])
    assert cfg.actor.model.max_prompt_length == 40


def test_a_checkpoint_without_a_config_is_read_as_before(old_lora_run, tiny, capsys):
    args = [f"actor.model.model_path={tiny}", "actor.model.unnorm_key=tiny_dataset", f"runner.ckpt_path={old_lora_run}"]
    code, out, err, _, _ = run("eval", ["--config-name", PPO, *args, "--dry-run"], capsys)
    assert code == 0 and "model settings from" not in out, err


# ---------------------------------------------------------------- checkpoint against the model
def model_args(model_path: Path, *more: str) -> list[str]:
    return [f"actor.model.model_path={model_path}", "actor.model.unnorm_key=tiny_dataset", *more]


DISCRETE = ["actor.model.action_head=discrete", "actor.model.use_proprio=false", "actor.model.num_images_in_input=1"]


@pytest.mark.parametrize("run_name,more,named", [
    ("old_lora_run", ["actor.model.is_lora=false"],
     ["actor/lora_adapter", "actor.model.is_lora=true", "actor.model.lora_rank=32"]),
    ("old_lora_run", ["actor.model.is_lora=true", "actor.model.add_value_head=false"],
     ["rl_heads.safetensors", "value_head.mlp.0.weight", "actor.model.add_value_head=true"]),
    ("old_lora_run", ["actor.model.is_lora=true", "actor.model.lora_rank=8"],
     ["actor.model.lora_rank = 8: expected 32", "adapter_config.json"]),
    ("old_full_run", ["actor.model.is_lora=false", "actor.model.add_value_head=true"],
     ["actor/model holds no value head", "actor.model.add_value_head=false"]),
    ("old_full_run", ["actor.model.is_lora=true"],
     ["adapter_model.safetensors is missing", "actor.model.is_lora=false"]),
])
def test_checkpoint_against_the_model(run_name, more, named, request, tiny, capsys):
    """What a rollout worker's ``read_checkpoint`` found 35-130 s in, found before the start."""
    ckpt = request.getfixturevalue(run_name)
    refused("eval", ["--config-name", EVAL, *model_args(tiny, *DISCRETE, *more), f"runner.ckpt_path={ckpt}",
                     "--dry-run"], capsys, "runner.ckpt_path", *named)


def test_resumed_checkpoint_against_the_model(old_lora_run, tiny, capsys):
    refused("train", ["--config-name", PPO, *model_args(tiny, "actor.model.is_lora=false"),
                      f"runner.resume_dir={old_lora_run}", "--dry-run"], capsys,
            "runner.resume_dir", "lora_adapter", "actor.model.is_lora=true")


@pytest.mark.parametrize("more,named", [
    (["actor.model.action_head=discrete"], ["action_head--100_checkpoint.pt", "action_head=l1_regression"]),
    (["actor.model.use_proprio=false"], ["proprio_projector--100_checkpoint.pt", "use_proprio true"]),
])
def test_model_folder_against_the_options(more, named, tiny_l1, capsys):
    refused("eval", ["--config-name", EVAL, *model_args(tiny_l1, *more), "--dry-run"], capsys, str(tiny_l1), *named)


# ---------------------------------------------------------------- model against the env
@pytest.mark.parametrize("more,named", [
    (["env.eval.init_params.robot_uids=null"],  # no wrist camera
     ["actor.model.num_images_in_input = 2", "obs['wrist_images']", "env.eval.init_params.robot_uids=panda_wristcam"]),
    (["env.eval.init_params.control_mode=pd_joint_delta_pos"],
     ["actor.model.action_dim = 7: expected 8", "env.eval", "pd_joint_delta_pos"]),
    (["runner.max_prompt_length=8"],
     ["actor.model.max_prompt_length = 8: expected at least 24", "runner.max_prompt_length",
      "pick up the red cube and move it to the green goal"]),
])
def test_model_against_the_env(more, named, tiny_l1, capsys):
    refused("eval", ["--config-name", EVAL, *model_args(tiny_l1, "actor.model.normalize_gripper=true", *more),
                     "--dry-run"], capsys, *named)


def test_proprio_size_against_the_env_state(tmp_path, capsys):
    """A checkpoint whose proprio projector takes 8 dimensions on PickCube's 29."""
    eight = write_tiny_checkpoint(tmp_path / "proprio8", proprio_dim=8, l1_head=True, num_shards=1)
    refused("eval", ["--config-name", EVAL, *model_args(eight, "actor.model.normalize_gripper=true"), "--dry-run"],
            capsys, "obs['states'] of 29 dimensions", "take 8", str(eight), "actor.model.use_proprio")


def test_small_policy_state_size_against_the_env(capsys):
    refused("train", ["--config-name", "maniskill_ppo_mlp", "actor.model.state_dim=30", "--dry-run"], capsys,
            "actor.model.state_dim = 30: expected 35", "env.train", "PushCube-v1")


def test_libero_wrist_camera_fix(tmp_path, tiny_l1, monkeypatch, capsys):
    monkeypatch.setenv("LIBERO_ASSETS_PATH", str(stand_in_assets(tmp_path / "assets")))
    refused("eval", ["--config-name", "libero_spatial_eval_openvla_oft", *model_args(tiny_l1),
                     "env.eval.init_params.wrist_camera=null", "--dry-run"], capsys,
            "needs obs['wrist_images']", "env.eval.init_params.wrist_camera=robot0_eye_in_hand")


# ---------------------------------------------------------------- eval reads only env.eval
def test_eval_checks_only_the_eval_env(tiny_l1, capsys):
    broken_train = ["env.train.total_num_envs=3", "env.train.init_params.id=NoSuchTask-v1"]
    code, _, err, _, _ = run("eval", ["--config-name", EVAL, *model_args(tiny_l1, "actor.model.normalize_gripper=true"),
                                   *broken_train, "--dry-run"], capsys)
    assert code == 0, err
    refused("train", ["--config-name", EVAL, *model_args(tiny_l1, "actor.model.normalize_gripper=true"),
                      *broken_train, "--dry-run"], capsys, "env.train")


# ---------------------------------------------------------------- what the checks rest on
@pytest.mark.slow
def test_maniskill_description_is_what_the_env_observes():
    """The driver's description (one scene, never rendered) against a real env's observation."""
    from envs.maniskill import check_params
    from envs.maniskill_scene import ManiSkillEnv

    cfg = load_env_config("maniskill_pick_cube", ["init_params.robot_uids=panda_wristcam",
                                                  "init_params.camera_heights=32", "init_params.camera_widths=32"])
    described = describe(cfg)
    env = ManiSkillEnv(check_params(OmegaConf.to_container(cfg.init_params)), max_episode_steps=2)
    try:
        assert described.state_dim == env.obs_spec["states"][0][0] == 29
        assert set(described.image_keys) == {"main_images", "wrist_images"} <= set(env.obs_spec)
        assert described.action_dim == env.action_dim == 7
        assert described.task_descriptions == (env.task_description,)
    finally:
        env.close()


def test_checkpoint_keys_are_options_the_policy_reads():
    for name in POLICIES.names():
        policy = POLICIES.get(name)
        keys = {k for c in policy.__mro__ for k in getattr(c, "config_keys", ())} | set(policy.refused_keys)
        assert set(policy.checkpoint_keys) <= keys, name


@pytest.mark.slow
def test_exit_code_2_from_the_command(old_lora_run, tiny):
    """The installed command itself: exit code 2 and the message within seconds."""
    tic = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "embodied", "eval", "--config-name", EVAL,
                           *model_args(tiny, *DISCRETE), f"runner.ckpt_path={old_lora_run}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "actor.model.is_lora is false" in done.stderr
    assert time.monotonic() - tic < SECONDS + 15  # a fresh interpreter imports torch, Hydra and ManiSkill
