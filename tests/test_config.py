"""Composition, schema, resolvers and validation of the shipped configs."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from embodied import cli
from conftest import stand_in_assets
from embodied.config import ConfigError, compose
from embodied.config.schema import CONFIG_DIR

SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "base")


def test_there_are_shipped_experiments():
    assert "maniskill_ppo_mlp" in SHIPPED


def _user_files(name: str, request) -> list[str]:
    """Math and agent configs read the user's model and prompt set before anything starts: give
    them the tiny ones the tests make. LIBERO configs check the asset folders: give them a stand-in
    layout (the suites' meshes are not available here). SFT configs read the user's
    demonstrations: give them made-up ones of the shape they expect."""
    tmp_path = request.getfixturevalue("tmp_path")
    if name.startswith("libero_"):
        assets = stand_in_assets(tmp_path / "libero_assets")
        files = [f"env.{split}.init_params.assets_path={assets}" for split in ("train", "eval")]
        if "_sft_" not in name:
            return files
        from test_demos import blank_frame, write_libero_demo

        frame = blank_frame() | {f"{camera}_image": np.zeros((64, 64, 3), np.uint8)
                                 for camera in ("agentview", "robot0_eye_in_hand")}
        (tmp_path / "libero_demos").mkdir()  # a folder, as LIBERO's datasets come: one file per task
        write_libero_demo(tmp_path / "libero_demos" / "task_demo.hdf5", [frame, frame], np.zeros((2, 7), np.float32))
        return [*files, f"data.demo_paths=[{tmp_path / 'libero_demos'}]"]
    if "_sft_" in name:
        from test_sft import write_demos

        demos = write_demos(tmp_path / "push_cube", image=(64, 64))
        return [f"data.demo_paths=[{demos}]"]
    if name.startswith("agent_"):
        tiny = request.getfixturevalue("tiny_agent")
        return [f"actor.model.model_path={tiny['model']}", f"data.train_data_paths=[{tiny['data'] / 'train.jsonl'}]",
                f"data.val_data_paths=[{tiny['data'] / 'test.jsonl'}]"]
    if not name.startswith("math_"):
        return []
    tiny = request.getfixturevalue("tiny_math")
    return [f"actor.model.model_path={tiny['model']}", f"data.train_data_paths=[{tiny['data'] / 'train.jsonl'}]",
            f"data.val_data_paths=[{tiny['data'] / 'test.jsonl'}]", "data.max_prompt_length=8", "runner.seq_length=12"]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_composes_and_validates(name, request):
    cfg, plan = cli.load(name, _user_files(name, request))
    assert cfg.runner.experiment_name == name
    assert plan.ranks["actor"] >= 1
    # fully resolved: no interpolation is left for a worker to trip over
    assert "${" not in OmegaConf.to_yaml(cfg)


@pytest.mark.parametrize("name", SHIPPED)
def test_dry_run_of_every_shipped_config_exits_zero(name, request, capsys):
    """In this process (the command's own code path, without the seconds of a fresh interpreter);
    the test below runs the console command once in a subprocess."""
    code = cli._main(["--config-name", name, "--dry-run", *_user_files(name, request)], "embodied-train")
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "placement:" in out.out and "config OK" in out.out


@pytest.mark.slow
def test_the_dry_run_command_runs_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-m", "embodied", "train", "--config-name", "maniskill_ppo_mlp", "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "placement:" in done.stdout and "config OK" in done.stdout


def test_env_groups_fill_both_splits_from_the_env_schema():
    cfg = compose("maniskill_ppo_mlp")
    for split in ("train", "eval"):
        env = cfg.env[split]
        assert env.env_type == "maniskill"
        assert set(OmegaConf.load(CONFIG_DIR / "env" / "base.yaml")) <= set(env)


def test_resolvers_and_env_interpolation(tmp_path, monkeypatch):
    """An experiment outside the repo, written as the public reference shows (hydra keys,
    search path through ${oc.env:REPO_PATH})."""
    monkeypatch.setenv("EMBODIED_TEST_NAME", "from-env")
    monkeypatch.setenv("REPO_PATH", str(CONFIG_DIR.parent))
    (tmp_path / "exp.yaml").write_text(
        "defaults:\n  - base\n  - env/maniskill_push_cube@env.train\n"
        "  - env/maniskill_push_cube@env.eval\n  - model/mlp@actor.model\n  - _self_\n"
        "hydra:\n  run:\n    dir: .\n  output_subdir: null\n"
        "  searchpath:\n    - file://${oc.env:REPO_PATH}/config/\n"
        "cluster:\n  component_placement:\n    actor,env,rollout: all\n"
        "runner:\n  experiment_name: ${oc.env:EMBODIED_TEST_NAME}\n  seq_length: 100\n"
        "  max_epochs: ${int_div:${runner.seq_length},7}\n"
        "  save_interval: ${multiply:${runner.max_epochs},3}\n"
        "data:\n  max_prompt_length: 30\n"
    )
    cfg = compose("exp", config_dir=tmp_path)
    assert cfg.runner.experiment_name == "from-env"
    assert cfg.runner.max_epochs == 14
    assert cfg.runner.save_interval == 42
    assert cfg.algorithm.sampling_params.max_new_tokens == 70  # subtract: seq_length - prompt
    assert cfg.runner.logger.log_path == "./results/from-env"


def test_unknown_key_in_an_experiment_file_is_named(tmp_path):
    (tmp_path / "exp.yaml").write_text(
        "defaults:\n  - maniskill_ppo_mlp\n  - _self_\n"
        f"hydra:\n  searchpath:\n    - file://{CONFIG_DIR}\n"
        "actor:\n  optim:\n    lrr: 0.1\n"
    )
    with pytest.raises(ConfigError, match=r"unknown config key actor\.optim\.lrr; did you mean actor\.optim\.lr\?"):
        compose("exp", config_dir=tmp_path)


def test_unknown_key_in_an_env_group_is_named(tmp_path):
    (tmp_path / "exp.yaml").write_text(
        "defaults:\n  - maniskill_ppo_mlp\n  - _self_\n"
        f"hydra:\n  searchpath:\n    - file://{CONFIG_DIR}\n"
        "env:\n  train:\n    max_episode_step: 10\n"
    )
    with pytest.raises(ConfigError, match=r"unknown config key env\.train\.max_episode_step;"):
        compose("exp", config_dir=tmp_path)


def test_config_is_read_only_after_validation():
    cfg = compose("maniskill_ppo_mlp")
    with pytest.raises(Exception):
        cfg.actor.optim.lr = 1.0


BAD = [
    (["actor.optim.lr=-0.001"], "actor.optim.lr = -0.001: expected a number > 0"),
    (["actor.optim.lr=fast"], "actor.optim.lr = 'fast': expected a number"),
    (["actor.optim.value_lr=0"], "actor.optim.value_lr = 0: expected a number > 0"),
    (["runner.max_epochs=2.5"], "runner.max_epochs = 2.5: expected an integer"),
    (["env.train.auto_reset=maybe"], "env.train.auto_reset = 'maybe': expected true or false"),
    (["algorithm.ratio_clip_eps=0"], "algorithm.ratio_clip_eps = 0: expected a number > 0"),
    (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c = 0.5: expected a number > 1"),
    (["algorithm.gamma=1.5"], "algorithm.gamma = 1.5: expected a number >= 0 and <= 1"),
    (["actor.micro_batch_size=0"], "actor.micro_batch_size = 0: expected a number >= 1"),
    (["actor.global_batch_size=0"], "actor.global_batch_size = 0: expected a number >= 1"),
    (["env.train.total_num_envs=0"], "env.train.total_num_envs = 0: expected a number >= 1"),
    (["data.max_prompt_length=2048"], "data.max_prompt_length: not supported here, because only text or agent envs"),
    (["cluster.component_placement.actor=all", "actor.micro_batch_size=200", "actor.global_batch_size=300"], "actor.global_batch_size = 300: expected a multiple of actor.micro_batch_size (200) x 2 actor rank(s) = 400"),
    (["actor.global_batch_size=600", "actor.micro_batch_size=100"], "actor.global_batch_size = 600: expected a divisor of the 3200 samples"),
    (["env.train.total_num_envs=15"], "env.train.total_num_envs = 15: expected a multiple of 2 env worker(s) x rollout.pipeline_stage_num (1) x env.train.group_size (1) = 2"),
    (["rollout.pipeline_stage_num=3", "env.eval.total_num_envs=66"], "env.train.total_num_envs = 64: expected a multiple of 2 env worker(s) x rollout.pipeline_stage_num (3)"),
    (["actor.model.num_action_chunks=3"], "actor.global_batch_size = 200: expected a divisor of the 1088 samples"),
    (["actor.model.add_value_head=false"], "actor.model.add_value_head = False: expected true with algorithm.adv_type=gae"),
    (["env.eval.env_type=isaac"], "env.eval.env_type = 'isaac': expected one of ['libero', 'maniskill'"),
    (["actor.model.model_type=rt2"], "actor.model.model_type = 'rt2': expected one of ["),
    (["runner.logger.logger_backends=[tensorboard,mlflow]"], "runner.logger.logger_backends = ['tensorboard', 'mlflow']: expected backends among"),
    (["algorithm.kl_penalty_type=k7"], "algorithm.kl_penalty_type = 'k7': expected one of ['kl', 'low_var_kl', 'abs', 'mse']"),
    (["algorithm.loss_agg_func=mean"], "algorithm.loss_agg_func = 'mean': expected one of"),
    (["cluster.num_nodes=0"], "cluster.num_nodes = 0: expected a number >= 1"),
    (["actor.enable_offload=true", "actor.channel.queue_size=2"], "actor.channel.queue_size = 2: expected 0 (unbounded) with actor.enable_offload"),
    (["actor.optim.lrr=1"], "unknown config key actor.optim.lrr; did you mean actor.optim.lr?"),
    (["+trainer.lr=1"], "unknown config key trainer"),
    (["algorithm.staleness_threshold=-1"], "algorithm.staleness_threshold = -1: expected a number >= 0"),
    (["algorithm.staleness_threshold=1", "runner.only_eval=true"],
     "algorithm.staleness_threshold = 1: expected 0 with runner.only_eval"),
    (["algorithm.staleness_threshold=1", "env.enable_offload=true"],
     "algorithm.staleness_threshold = 1: expected 0 with env.enable_offload"),
    (["algorithm.staleness_threshold=1", "actor.offload_optimizer=true"],
     "algorithm.staleness_threshold = 1: expected 0 with actor.offload_optimizer"),
    (["actor.offload_grad=true", "actor.channel.queue_size=2"],
     "actor.channel.queue_size = 2: expected 0 (unbounded) with actor.offload_grad"),
    (["algorithm.loss_type=decoupled_actor_critic", "rollout.recompute_logprobs=true"],
     "rollout.recompute_logprobs = True: expected false with algorithm.loss_type=decoupled_actor_critic"),
    (["algorithm.behave_weight_threshold=2.0"], "algorithm.behave_weight_threshold: not supported here, because "
                                                "algorithm.loss_type ppo does not read it (decoupled_actor_critic does"),
    (["algorithm.critic_warmup=-1"], "algorithm.critic_warmup = -1: expected a number >= 0"),
    (["env.train.max_steps_per_rollout_epoch=100", "env.train.auto_reset=false"],
     "env.train.max_steps_per_rollout_epoch = 100: expected null or max_episode_steps (50) without env.train.auto_reset"),
    (["env.eval.max_steps_per_rollout_epoch=100"], "env.eval.max_steps_per_rollout_epoch: not supported: an evaluation"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[o[0] for o, _ in BAD])
def test_bad_config_exits_2_with_one_message_naming_the_key(overrides, message, capsys):
    code = cli._main(["--config-name", "maniskill_ppo_mlp", *overrides], "embodied-train")
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1  # one message, one line


@pytest.mark.parametrize("overrides, message", [
    (["env.train.use_fixed_reset_state_ids=false"],
     "env.train.use_fixed_reset_state_ids = False: expected true with algorithm.adv_type=grpo"),
    (["algorithm.group_size=1"], "algorithm.group_size = 1: expected at least 2 with algorithm.adv_type=grpo"),
    (["algorithm.critic_warmup=2"],
     "algorithm.critic_warmup: not supported here, because algorithm.adv_type grpo does not read it (gae does"),
    (["env.train.group_size=16"], "env.train.group_size = 16: expected algorithm.group_size (8) or a divisor of it"),
    (["env.train.total_num_envs=24", "env.train.group_size=4"], "env.train.total_num_envs = 24: expected a multiple "
     "of 2 env worker(s) x rollout.pipeline_stage_num (1) x algorithm.group_size (8): an advantage group lies in one "
     "env stage"),
])
def test_grpo_needs_groups_of_fixed_shared_reset_states_and_trains_no_critic(overrides, message, capsys):
    code = cli._main(["--config-name", "maniskill_grpo_mlp", *overrides], "embodied-train")
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_type=reinpp_baseline", "algorithm.group_size=1"],
     "algorithm.group_size = 1: expected at least 2 with algorithm.adv_type=reinpp_baseline"),
    (["algorithm.adv_type=reinpp", "algorithm.gamma=0.9"],
     "algorithm.gamma: not supported here, because algorithm.adv_type reinpp does not read it (gae does"),
    (["algorithm.adv_type=reinpp_baseline", "algorithm.norm_adv_by_std_in_grpo=false"],
     "algorithm.norm_adv_by_std_in_grpo: not supported here, because algorithm.adv_type reinpp_baseline does not "
     "read it (grpo does"),
])
def test_reinforce_plus_plus_reads_no_discount_and_its_baseline_needs_groups(overrides, message, capsys):
    code = cli._main(["--config-name", "maniskill_grpo_mlp", *overrides], "embodied-train")
    assert code == 2
    assert message in capsys.readouterr().err
    assert cli._main(["--config-name", "maniskill_grpo_mlp", "--dry-run", overrides[0]], "embodied-train") == 0


def _placement_config(tmp_path: Path, lines: str) -> str:
    (tmp_path / "exp.yaml").write_text(
        "defaults:\n  - base\n  - env/maniskill_push_cube@env.train\n"
        "  - env/maniskill_push_cube@env.eval\n  - model/mlp@actor.model\n  - _self_\n"
        "actor:\n  global_batch_size: 800\n  micro_batch_size: 400\n"
        f"hydra:\n  searchpath:\n    - file://{CONFIG_DIR}\n"
        "cluster:\n  component_placement:\n" + lines
    )
    return str(tmp_path)


@pytest.mark.parametrize(
    "lines, message",
    [
        ("    actor,env,rollout: 0-3\n", "device rank 3 does not exist; the cluster has 2 device(s)"),
        ("    actor: 3-1\n    env,rollout: 0\n", "range '3-1' must run upwards"),
        ("    actor: a\n    env,rollout: 0\n", "'a' is not a device rank"),
        ("    actor: 0\n    env: 0,0\n    rollout: 1\n", "named more than once"),
        ("    actor,env: 0\n    env,rollout: 1\n", "'env' is placed twice"),
        ("    actor,env: all\n", "a line that places 'rollout'"),
        ("    {}\n", "cluster.component_placement is empty"),
    ],
)
def test_bad_placement_exits_2_before_anything_starts(tmp_path, lines, message, capsys):
    config_dir = _placement_config(tmp_path, lines)
    code = cli._main(["--config-name", "exp", "--config-path", config_dir, "cluster.num_gpus_per_node=2"],
                     "embodied-train")
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_exit_code_is_2_on_a_bad_value():
    done = subprocess.run(
        [sys.executable, "-m", "embodied", "eval", "actor.optim.lr=-1"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "embodied-eval: config error: actor.optim.lr = -1: expected a number > 0"


def test_overrides_and_options_may_come_in_any_order(capsys):
    code = cli._main(["actor.optim.lr=1e-4", "--config-name", "maniskill_grpo_mlp", "--dry-run",
                      "runner.max_epochs=3"], "embodied-train")
    out = capsys.readouterr().out
    assert code == 0
    assert "experiment: maniskill_grpo_mlp" in out and "lr 0.0001" in out and "steps: 3," in out


@pytest.mark.parametrize("config, overrides, message", [
    ("maniskill_sft_mlp", ["algorithm.importance_sampling_fix=true"], "algorithm.importance_sampling_fix: not "
     "supported here, because algorithm.loss_type sft does not read it"),
    ("maniskill_ppo_mlp", ["algorithm.importance_sampling_clip=3"], "algorithm.importance_sampling_clip: not "
     "supported here, because algorithm.importance_sampling_fix is false"),
    ("maniskill_ppo_mlp", ["algorithm.importance_sampling_fix=true"], "rollout.recompute_logprobs = False: expected "
     "true with algorithm.importance_sampling_fix"),
])
def test_importance_sampling_keys_are_refused_where_nothing_reads_them(config, overrides, message, capsys):
    assert cli._main(["--config-name", config, *overrides], "embodied-train") == 2
    assert message in capsys.readouterr().err
