"""Semantic checks of a composed config, run before Ray or any worker starts.

Each rule raises ``ConfigError`` naming the key, its value and what was expected, so a bad
config costs seconds instead of a crashed cluster.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied import checkpoint, schema
from embodied.refused import refuse_unsupported
from embodied.config import CONFIG_DIR, ConfigError, chunk_steps
from embodied.placement import PlacementError, PlacementPlan, plan_placement
from envs import ENV_CHECKS, ENVS
from envs.vector_env import EnvSetupError
from policies import POLICIES

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("runner.task_type", "cluster.component_placement")

LOGGER_BACKENDS = ("tensorboard", "wandb", "swanlab")


def validate(cfg: DictConfig) -> PlacementPlan:
    """Check every rule; return the placement plan the cluster will be launched with."""
    refuse_unsupported(cfg)
    if cfg.data.max_prompt_length >= cfg.runner.seq_length:
        _fail("data.max_prompt_length", cfg.data.max_prompt_length,
              f"fewer tokens than runner.seq_length ({cfg.runner.seq_length}), leaving room to generate")
    _rules(cfg)  # after the prompt length: the causal LM's action_dim is what remains of seq_length

    backends = list(cfg.runner.logger.logger_backends)
    for backend in backends:
        if backend not in LOGGER_BACKENDS:
            _fail("runner.logger.logger_backends", backends, f"backends among {list(LOGGER_BACKENDS)}")

    model = cfg.actor.model
    if not model:
        _fail("actor.model", {}, "a model group, e.g. `model/mlp@actor.model` in the defaults list")
    if model.model_type not in POLICIES:
        _fail("actor.model.model_type", model.model_type, f"one of {POLICIES.names()}")

    for key in ("model_path", "lora_path"):
        path = model.get(key)
        if path is not None and not os.path.exists(path):
            _fail(f"actor.model.{key}", path, "an existing checkpoint folder")
    _policy_checks(model)
    adv = cfg.algorithm.adv_type
    if adv == "grpo" and cfg.algorithm.group_size < 2:
        _fail("algorithm.group_size", cfg.algorithm.group_size,
              "at least 2 with algorithm.adv_type=grpo (advantages are normalized within a group)")
    if adv == "gae" and not model.add_value_head:
        _fail("actor.model.add_value_head", model.add_value_head,
              "true with algorithm.adv_type=gae (PPO needs a value head to bootstrap)")

    plan = _placement(cfg)
    _training_options(cfg, plan.accelerator)
    actor_ranks = plan.world_size("actor")
    per_step = cfg.actor.micro_batch_size * actor_ranks
    if cfg.actor.global_batch_size % per_step:
        _fail("actor.global_batch_size", cfg.actor.global_batch_size,
              f"a multiple of actor.micro_batch_size ({cfg.actor.micro_batch_size}) x "
              f"{actor_ranks} actor rank(s) = {per_step}")

    _writable("runner.logger.log_path", cfg.runner.logger.log_path)
    _writable("runner.logger.log_path (its checkpoints folder)",
              os.path.join(cfg.runner.logger.log_path, "checkpoints"))
    if cfg.runner.task_type == "embodied":
        for split in ("train", "eval"):
            video = cfg.env[split].get("video_cfg")
            if video and video.save_video:
                _writable(f"env.{split}.video_cfg.video_base_dir", video.video_base_dir)
    if cfg.runner.only_eval and (cfg.runner.ckpt_path is not None or model.get("model_path") is None):
        _checkpoint(cfg, "runner.ckpt_path")  # without one, eval runs the pretrained actor.model.model_path
    if cfg.runner.resume_dir not in (None, "auto"):
        _checkpoint(cfg, "runner.resume_dir")
    _pass_k(cfg)
    _validate_envs(cfg, plan)
    text = [f"env.{s}" for s in schema.ENV_SPLITS if cfg.env[s] and cfg.env[s].env_type == "text"]
    if cfg.runner.task_type == "math":
        _validate_text(cfg)
    elif text:
        _fail("runner.task_type", cfg.runner.task_type, f"math with the text env of {text[0]}")
    return plan


def _validate_text(cfg: DictConfig) -> None:
    """Text envs (math): the causal LM, its tokenizer and the prompt sets, read once here so that
    a missing folder, a malformed line or a missing key fails before any worker starts."""
    from envs.text import DataError, load_prompts, load_tokenizer

    model, train = cfg.actor.model, cfg.env.train
    if train.env_type != "text":
        _fail("env.train.env_type", train.env_type, "text with runner.task_type=math")
    if model.model_type != "causal_lm":
        _fail("actor.model.model_type", model.model_type, "causal_lm with a text env")
    if model.model_path is None or not os.path.isfile(os.path.join(model.model_path, "config.json")):
        _fail("actor.model.model_path", model.model_path, "a Hugging Face model folder (with config.json)")
    if train.total_num_envs != cfg.data.rollout_batch_size * train.group_size:
        _fail("env.train.total_num_envs", train.total_num_envs,
              f"data.rollout_batch_size ({cfg.data.rollout_batch_size}) x group_size ({train.group_size})")
    try:
        tok = load_tokenizer(train.init_params)
        for split in ("train", "eval"):
            if cfg.env[split].env_type == "text":
                load_prompts(cfg.env[split].init_params, tok)
    except DataError as err:
        raise ConfigError(str(err)) from None



def _pass_k(cfg: DictConfig) -> None:
    """``data.val_pass_k`` above 1 samples on the ``env.eval_pass_k`` text envs, k per prompt."""
    k = cfg.data.val_pass_k
    if k == 1:
        return
    env = cfg.env.eval_pass_k
    if not env or env.env_type != "text":
        raise ConfigError(f"data.val_pass_k = {k}: not supported here, because pass@k needs a text env split "
                          "env.eval_pass_k (e.g. `env/math_val_pass_k@env.eval_pass_k` in the defaults list)")
    if env.group_size != k:
        _fail("env.eval_pass_k.group_size", env.group_size, f"data.val_pass_k ({k}): k responses per prompt")
    if not cfg.actor.model.do_sample:
        _fail("data.val_pass_k", k,
              "1 with algorithm.sampling_params.do_sample=false (k greedy answers are one answer)")


def _validate_envs(cfg: DictConfig, plan: PlacementPlan) -> None:
    """What every task shares (robots and text): env splits, groups and batch arithmetic."""
    chunks = cfg.actor.model.num_action_chunks
    env_ranks = plan.world_size("env")
    stages = cfg.rollout.pipeline_stage_num
    for split in ("train", "eval", "eval_pass_k") if cfg.data.val_pass_k > 1 else ("train", "eval"):
        env = cfg.env[split]
        if not env:
            _fail(f"env.{split}", {}, f"an env group, e.g. `env/maniskill_push_cube@env.{split}`")
        if env.env_type not in ENVS:
            _fail(f"env.{split}.env_type", env.env_type, f"one of {ENVS.names()}")
        if env.each_reset_state_once and env.auto_reset:
            _fail(f"env.{split}.auto_reset", True, f"false with env.{split}.each_reset_state_once "
                  "(one episode per env and round)")
        if env.env_type == "libero" and cfg.actor.model.model_type == "openvla_oft":
            _libero_gripper(cfg.actor.model, env, split)
        if env.env_type in ENV_CHECKS:  # the adapter's own checks: suite, files, assets
            try:
                ENV_CHECKS.get(env.env_type)(env)
            except EnvSetupError as err:
                raise ConfigError(f"env.{split}: {err}") from None
        unit = env_ranks * stages * env.group_size
        if env.total_num_envs % unit:
            _fail(f"env.{split}.total_num_envs", env.total_num_envs,
                  f"a multiple of {env_ranks} env worker(s) x rollout.pipeline_stage_num "
                  f"({stages}) x env.{split}.group_size ({env.group_size}) = {unit}")
    rollout_ranks, actor_ranks = plan.world_size("rollout"), plan.world_size("actor")
    if env_ranks % rollout_ranks:
        _fail("cluster.component_placement", OmegaConf.to_container(cfg.cluster.component_placement),
              f"env ranks ({env_ranks}) a multiple of rollout ranks ({rollout_ranks}): each rollout "
              "rank serves whole env ranks")
    train = cfg.env.train
    shard = train.total_num_envs // actor_ranks
    if train.total_num_envs % actor_ranks or shard % train.group_size:
        _fail("env.train.total_num_envs", train.total_num_envs,
              f"a multiple of {actor_ranks} actor rank(s) x env.train.group_size ({train.group_size}) "
              "so that every actor rank trains on whole groups")
    if cfg.algorithm.adv_type == "grpo":
        if not train.use_fixed_reset_state_ids:
            _fail("env.train.use_fixed_reset_state_ids", False,
                  "true with algorithm.adv_type=grpo (a group must share its reset state)")
        if train.group_size != cfg.algorithm.group_size:
            _fail("env.train.group_size", train.group_size,
                  f"algorithm.group_size ({cfg.algorithm.group_size}) with adv_type=grpo")
    if cfg.actor.enable_offload and cfg.actor.channel.queue_size:
        _fail("actor.channel.queue_size", cfg.actor.channel.queue_size,
              "0 (unbounded) with actor.enable_offload: an offloaded actor takes a step's "
              "trajectories only after the whole rollout")
    samples = train.total_num_envs * chunk_steps(train.max_episode_steps, chunks) * cfg.algorithm.rollout_epoch
    if samples % cfg.actor.global_batch_size:
        _fail("actor.global_batch_size", cfg.actor.global_batch_size,
              f"a divisor of the {samples} samples a step collects (env.train.total_num_envs x "
              "ceil(max_episode_steps / num_action_chunks) x algorithm.rollout_epoch)")


def _libero_gripper(model: DictConfig, env: DictConfig, split: str) -> None:
    """OpenVLA-OFT's gripper output must be what the LIBERO env takes: LIBERO's datasets store
    the gripper as [0 close, 1 open]; ``normalize_gripper`` makes that -1/+1 (+1 open) and
    ``invert_gripper`` flips it, so the env's ``gripper_open_action`` must be -1 with the flip."""
    if not model.normalize_gripper:
        _fail("actor.model.normalize_gripper", False, "true with env_type libero (LIBERO's gripper "
              "takes -1/+1; the model predicts the dataset's [0, 1])")
    opens = -1 if model.invert_gripper else 1
    given = env.init_params.get("gripper_open_action")
    if given != opens:
        _fail(f"env.{split}.init_params.gripper_open_action", given,
              f"{opens} with actor.model.invert_gripper={model.invert_gripper} (the model's "
              f"action that opens the gripper)")


def _training_options(cfg: DictConfig, accelerator: str) -> None:
    """Combinations of optimizer, precision and offload options that cannot work."""
    optim, fsdp = cfg.actor.optim, cfg.actor.fsdp_config
    schema = OmegaConf.load(CONFIG_DIR / "base.yaml").actor.optim
    if optim.optimizer == "sgd":
        for key in ("adam_beta1", "adam_beta2", "adam_eps"):
            if optim[key] != schema[key]:
                raise ConfigError(f"actor.optim.{key}: not supported with actor.optim.optimizer=sgd, "
                                  "because SGD keeps no moment estimates")
    if cfg.actor.lr_sched.min_lr > cfg.actor.lr_sched.max_lr:
        _fail("actor.lr_sched.min_lr", cfg.actor.lr_sched.min_lr,
              f"at most actor.lr_sched.max_lr ({cfg.actor.lr_sched.max_lr})")
    gpu = accelerator == "gpu"
    if fsdp.amp_autocast.enabled and fsdp.amp_autocast.precision == "fp16" and not gpu:
        raise ConfigError("actor.fsdp_config.amp_autocast.precision: not supported: fp16 on CPU, "
                          "because fp16 training needs loss scaling, which runs on CUDA; use bf16")
    if fsdp.grad_scaler.enabled and not (gpu and fsdp.amp_autocast.enabled
                                         and fsdp.amp_autocast.precision == "fp16"):
        raise ConfigError("actor.fsdp_config.grad_scaler.enabled: not supported here, because loss "
                          "scaling is for fp16 autocast on CUDA (amp_autocast.enabled with precision fp16)")
    if fsdp.offload_pin_memory and not (gpu and fsdp.cpu_offload):
        raise ConfigError("actor.fsdp_config.offload_pin_memory: not supported here, because pinned "
                          "host memory needs CUDA and actor.fsdp_config.cpu_offload")
    if fsdp.cpu_offload and cfg.actor.enable_offload:
        raise ConfigError("actor.enable_offload: not supported with actor.fsdp_config.cpu_offload, "
                          "because the actor's state already lives in host memory")


def devices_per_node(cfg: DictConfig) -> tuple[int, str]:
    """Devices on each node and their kind: GPUs where torch sees them, else CPU slots."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accelerator = "gpu" if gpus else "cpu"
    configured = cfg.cluster.num_gpus_per_node
    if configured is not None:
        return configured, accelerator
    return (gpus or os.cpu_count() or 1), accelerator


def _placement(cfg: DictConfig) -> PlacementPlan:
    per_node, accelerator = devices_per_node(cfg)
    lines = OmegaConf.to_container(cfg.cluster.component_placement)
    try:
        plan = plan_placement(lines, cfg.cluster.num_nodes, per_node, accelerator)
    except PlacementError as err:
        raise ConfigError(str(err)) from None
    for component in ("actor", "rollout", "env"):
        if component not in plan.components:
            _fail("cluster.component_placement", lines, f"a line that places {component!r}")
    return plan


def _writable(key: str, path: str) -> None:
    """``path`` is a folder this process can write, or can be made in one: probed by creating
    (and removing) a file in it or in its nearest existing ancestor, which also catches
    read-only mounts and, unlike ``os.access``, holds for root too."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        _fail(key, path, f"a folder that can be created, but {folder} is a file")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        _fail(key, path, f"a writable folder, but {folder} is not writable ({err.strerror})")


def _policy_checks(model: DictConfig) -> None:
    """The policy's own checks of its checkpoint folder (``check_config``), when it has any and a
    ``model_path`` is set: a folder that does not fit the config fails here, before any worker
    starts."""
    check = getattr(POLICIES.get(model.model_type), "check_config", None)
    if check is None or model.get("model_path") is None:
        return
    try:
        check(OmegaConf.to_container(model, resolve=True))
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise ConfigError(str(err).strip("'\"")) from None


def _checkpoint(cfg: DictConfig, key: str) -> None:
    path = OmegaConf.select(cfg, key)
    if path is None:
        _fail(key, None, "a checkpoint folder (global_step_<N>, or the folder holding them)")
    try:
        checkpoint.resolve(path, key)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None


def _rules(cfg: DictConfig) -> None:
    """The allowed values declared next to each default in config/ (``embodied.schema``), for
    the keys of the splits and model this config has."""
    model_type = OmegaConf.select(cfg, "actor.model.model_type")
    for key, leaf in schema.leaves(model_type).items():
        if leaf.rule is None or (key.startswith("actor.model.") and not cfg.actor.model):
            continue
        if key.startswith("env.") and not cfg.env[key.split(".")[1]]:
            continue
        value = OmegaConf.select(cfg, key)
        if not leaf.rule.allows(value):
            _fail(key, value, leaf.rule.expected())


def _fail(key: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{key} = {value!r}: expected {expected}")
