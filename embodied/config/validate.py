"""Semantic checks of a composed config, run before Ray or any worker starts, and the run's
arithmetic they hold (chunk steps, rollout window, offloaded parts, tensor-parallel replicas,
training steps), which the runner and the workers use as written here.

Each rule raises ``ConfigError`` naming the key, its value and what was expected, so a bad
config costs seconds instead of a crashed cluster. The checks of a choice come from its
registry entry (a training backend's ``check``, an env's ``describe``, a policy's
``check_config``); the walk from the command line to the plan stays short (tests/test_config_walk.py).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError
from core.registry import load
from embodied import checkpoint
from embodied.algorithms import ADVANTAGES, POLICY_LOSSES
from embodied.backends import BACKENDS
from embodied.config import preflight, schema
from embodied.config.refused import refuse_unsupported
from embodied.placement import PlacementError, PlacementPlan, plan_placement
from envs import ENVS, describe
from policies import POLICIES

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("runner.task_type", "cluster.component_placement", "actor.training_backend", "runner.max_steps",
               "runner.max_epochs", "env.*.max_steps_per_rollout_epoch", "actor.offload_weight",
               "actor.offload_optimizer", "actor.offload_grad")

LOGGER_BACKENDS = ("tensorboard", "wandb", "swanlab")


def validate(cfg: DictConfig) -> PlacementPlan:
    """Check every rule; return the placement plan the cluster will be launched with."""
    refuse_unsupported(cfg)
    if cfg.data.max_prompt_length >= cfg.runner.seq_length:
        _fail("data.max_prompt_length", cfg.data.max_prompt_length,
              f"fewer tokens than runner.seq_length ({cfg.runner.seq_length}), leaving room to generate")
    schema.check_rules(cfg)  # after the prompt length: a text model's action_dim is what remains of seq_length

    loggers = list(cfg.runner.logger.logger_backends)
    for logger in loggers:
        if logger not in LOGGER_BACKENDS:
            _fail("runner.logger.logger_backends", loggers, f"backends among {list(LOGGER_BACKENDS)}")

    model = cfg.actor.model
    if not model:
        _fail("actor.model", {}, f"a model group `model/<model_type>@actor.model` in the defaults list "
              f"(model_type one of {POLICIES.names()})")
    if model.model_type not in POLICIES:
        _fail("actor.model.model_type", model.model_type, f"one of {POLICIES.names()}")

    for key in ("model_path", "lora_path"):
        path = model.get(key)
        if path is not None and not os.path.exists(path):
            _fail(f"actor.model.{key}", path, "an existing checkpoint folder")
    _policy_checks(model)
    adv = cfg.algorithm.adv_type
    needs = ADVANTAGES.declared(adv)
    imitation = POLICY_LOSSES.declared(cfg.algorithm.loss_type)["imitation"]
    if imitation:  # SFT: no advantages; its demonstrations checked below
        needs = dict.fromkeys(needs, False)
    if cfg.runner.only_eval:  # an evaluation computes no advantages
        needs = dict.fromkeys(needs, False)
    if needs["needs_groups"] and cfg.algorithm.group_size < 2:
        _fail("algorithm.group_size", cfg.algorithm.group_size,
              f"at least 2 with algorithm.adv_type={adv} (advantages are normalized within a group)")
    if needs["needs_value_head"] and not model.add_value_head:
        _fail("actor.model.add_value_head", model.add_value_head,
              f"true with algorithm.adv_type={adv} (it bootstraps from the critic's values)")

    if cfg.algorithm.use_valid_token_scale and cfg.algorithm.loss_agg_func != "token-mean":
        raise ConfigError(f"algorithm.use_valid_token_scale: not supported with algorithm.loss_agg_func "
                          f"{cfg.algorithm.loss_agg_func}, because it weighs micro-batches into one mean over "
                          "the minibatch's valid tokens: token-mean's")

    if cfg.algorithm.importance_sampling_fix and not cfg.rollout.recompute_logprobs:
        _fail("rollout.recompute_logprobs", False, "true with algorithm.importance_sampling_fix (its weight is the "
              "actor's recomputed log-probs against the rollout's)")

    plan = _placement(cfg)
    _backends(cfg, plan.ranks["actor"])
    _training_options(cfg, plan.accelerator)
    _overlap(cfg)
    groups, who = _actor_groups(cfg, plan)
    per_step = cfg.actor.micro_batch_size * groups
    if cfg.actor.global_batch_size % per_step and not cfg.runner.only_eval:
        _fail("actor.global_batch_size", cfg.actor.global_batch_size,
              f"a multiple of actor.micro_batch_size ({cfg.actor.micro_batch_size}) x {who} = {per_step}")

    _writable("runner.logger.log_path", cfg.runner.logger.log_path)
    _writable("runner.logger.log_path (its checkpoints folder)",
              os.path.join(cfg.runner.logger.log_path, "checkpoints"))
    if cfg.runner.task_type == "embodied":
        for split in ("eval",) if cfg.runner.only_eval else ("train", "eval"):
            video = cfg.env[split].get("video_cfg")
            if video and video.save_video:
                _writable(f"env.{split}.video_cfg.video_base_dir", video.video_base_dir)
    if cfg.runner.only_eval and (cfg.runner.ckpt_path is not None or model.get("model_path") is None
                                 and not imitation):
        _checkpoint(cfg, "runner.ckpt_path")  # without one, eval runs the pretrained actor.model.model_path
    if not cfg.runner.only_eval and cfg.runner.ckpt_path is not None:
        _checkpoint(cfg, "runner.ckpt_path")  # the weights training starts from
    if cfg.runner.resume_dir not in (None, "auto"):
        _checkpoint(cfg, "runner.resume_dir")
    preflight.check_checkpoints(cfg)
    _pass_k(cfg)
    _validate_envs(cfg, plan)
    if imitation:
        _demonstrations(cfg)
    return plan


def _demonstrations(cfg: DictConfig) -> None:
    """SFT: embodied envs, and demo files that fit the eval env and the model (read from their
    metadata: layout, action dims, image size)."""
    from embodied import demonstrations

    if cfg.runner.task_type != "embodied":
        _fail("algorithm.loss_type", cfg.algorithm.loss_type,
              f"one of {[n for n in POLICY_LOSSES.names() if not POLICY_LOSSES.declared(n)['imitation']]} with "
              f"runner.task_type={cfg.runner.task_type} (demonstrations are of embodied envs)")
    demonstrations.check(cfg)


def _backends(cfg: DictConfig, actor_ranks: int) -> None:
    """The model has a class for ``actor.training_backend`` (the backend's own checks follow:
    ``TrainingBackend.check``) and an engine for ``rollout.backend`` that can run here."""
    backend, model_type = cfg.actor.training_backend, cfg.actor.model.model_type
    trained = ["fsdp", *POLICIES.declared(model_type)["training"]]
    if backend not in trained:
        raise ConfigError(f"actor.training_backend = {backend!r}: expected {' or '.join(trained)} with "
                          f"model_type {model_type}")
    BACKENDS.get(backend).check(cfg, actor_ranks)
    engine = cfg.rollout.backend
    if engine == "huggingface":
        return
    engines = POLICIES.declared(model_type)["rollout"]
    if engine not in engines:
        raise ConfigError(f"rollout.backend = {engine!r}: expected {' or '.join(['huggingface', *engines])} with "
                          f"model_type {model_type}")
    why = load(engines[engine]).unavailable()
    if why:
        raise ConfigError(f"rollout.backend = {engine!r}: not supported here, because {why}")


def _overlap(cfg: DictConfig) -> None:
    """``algorithm.staleness_threshold`` > 0 overlaps rollouts with updates: it needs a training
    run whose roles stay resident, and a decoupled loss needs the rollout's own log-probs."""
    stale, loss = cfg.algorithm.staleness_threshold, cfg.algorithm.loss_type
    if stale and cfg.runner.only_eval:
        _fail("algorithm.staleness_threshold", stale, "0 with runner.only_eval (an evaluation has no updates "
                                                      "to overlap with)")
    if stale:
        for role in ("actor", "rollout", "env"):
            if key := _offload_setting(cfg, role):
                _fail("algorithm.staleness_threshold", stale, f"0 with {key} (offloading makes the phases take "
                                                              "turns)")
    if POLICY_LOSSES.declared(loss)["proximal"] and cfg.rollout.recompute_logprobs:
        _fail("rollout.recompute_logprobs", True, f"false with algorithm.loss_type={loss} (it weighs samples by "
                                                  "the log-probs of the policy that acted, the rollout's)")


def _actor_groups(cfg: DictConfig, plan: PlacementPlan) -> tuple[int, str]:
    """How many shares a step's samples split into on the actor (data-parallel ranks), and
    those words for messages."""
    ranks, tp = plan.ranks["actor"], replicas(cfg)
    if tp == 1:
        return ranks, f"{ranks} actor rank(s)"
    return ranks // tp, f"{ranks // tp} data-parallel group(s) of {tp} tensor-parallel actor ranks"


def _pass_k(cfg: DictConfig) -> None:
    """``data.val_pass_k`` above 1 samples on the ``env.eval_pass_k`` envs (of an env that reads
    prompt data), k per prompt."""
    k = cfg.data.val_pass_k
    if k == 1:
        return
    env = cfg.env.eval_pass_k
    prompted = [name for name in ENVS.names() if "data" in ENVS.reads(name)]
    if not env or env.env_type not in prompted:
        raise ConfigError(f"data.val_pass_k = {k}: not supported here, because pass@k needs an env split "
                          f"env.eval_pass_k of env_type {' or '.join(prompted)} (e.g. "
                          "`env/math_val_pass_k@env.eval_pass_k` in the defaults list)")
    if env.group_size != k:
        _fail("env.eval_pass_k.group_size", env.group_size, f"data.val_pass_k ({k}): k responses per prompt")
    if not cfg.actor.model.do_sample:
        _fail("data.val_pass_k", k,
              "1 with algorithm.sampling_params.do_sample=false (k greedy answers are one answer)")


def _validate_envs(cfg: DictConfig, plan: PlacementPlan) -> None:
    """What every task shares (robots and text): env splits, groups and batch arithmetic; an
    evaluation (``runner.only_eval``) runs no training env, so env.train is not checked."""
    chunks = cfg.actor.model.num_action_chunks
    env_ranks = plan.ranks["env"]
    stages = cfg.rollout.pipeline_stage_num
    task = cfg.runner.task_type
    policy = POLICIES.get(cfg.actor.model.model_type)
    model_options = OmegaConf.to_container(cfg.actor.model, resolve=True)
    splits = ("eval", "eval_pass_k") if cfg.data.val_pass_k > 1 else ("eval",)
    for split in splits if cfg.runner.only_eval else ("train", *splits):
        env = cfg.env[split]
        if not env:
            _fail(f"env.{split}", {}, f"an env group `env/<group>@env.{split}` in the defaults list")
        if env.env_type not in ENVS:
            _fail(f"env.{split}.env_type", env.env_type, f"one of {ENVS.names()}")
        if ENVS.declared(env.env_type)["task_type"] != task:
            _fail(f"env.{split}.env_type", env.env_type,
                  f"{' or '.join(ENVS.where(task_type=task))} with runner.task_type={task}")
        if env.each_reset_state_once and env.auto_reset:
            _fail(f"env.{split}.auto_reset", True, f"false with env.{split}.each_reset_state_once "
                  "(one episode per env and round)")
        try:  # the adapter's own checks: suite, files, assets, prompt sets
            description = describe(env)
        except ConfigError as err:
            raise ConfigError(f"env.{split}: {err}") from None
        policy.check_env(model_options, description, split)  # e.g. the policy's gripper against the env's
        unit = env_ranks * stages * env.group_size
        if env.total_num_envs % unit:
            _fail(f"env.{split}.total_num_envs", env.total_num_envs,
                  f"a multiple of {env_ranks} env worker(s) x rollout.pipeline_stage_num "
                  f"({stages}) x env.{split}.group_size ({env.group_size}) = {unit}")
    if task not in POLICIES.declared(cfg.actor.model.model_type)["task_types"]:
        _fail("actor.model.model_type", cfg.actor.model.model_type,
              f"{' or '.join(n for n in POLICIES.names() if task in POLICIES.declared(n)['task_types'])} "
              f"with runner.task_type={task}")
    rollout_ranks = plan.ranks["rollout"]
    if env_ranks % rollout_ranks:
        _fail("cluster.component_placement", OmegaConf.to_container(cfg.cluster.component_placement),
              f"env ranks ({env_ranks}) a multiple of rollout ranks ({rollout_ranks}): each rollout "
              "rank serves whole env ranks")
    if cfg.runner.only_eval:
        return
    train = cfg.env.train
    if "data" in ENVS.reads(train.env_type):  # prompts per step x responses per prompt
        if train.total_num_envs != cfg.data.rollout_batch_size * train.group_size:
            _fail("env.train.total_num_envs", train.total_num_envs,
                  f"data.rollout_batch_size ({cfg.data.rollout_batch_size}) x group_size ({train.group_size})")
    adv = cfg.algorithm.adv_type
    grouped = ADVANTAGES.declared(adv)["needs_groups"]
    # an advantage group is algorithm.group_size envs; env.train.group_size of them share a reset state
    group, key = (cfg.algorithm.group_size, "algorithm.group_size") if grouped else (train.group_size,
                                                                                   "env.train.group_size")
    groups, who = _actor_groups(cfg, plan)
    shard = train.total_num_envs // groups
    if train.total_num_envs % groups or shard % group:
        _fail("env.train.total_num_envs", train.total_num_envs,
              f"a multiple of {who} x {key} ({group}) so that every actor rank trains on whole groups")
    if grouped:
        if not train.use_fixed_reset_state_ids:
            _fail("env.train.use_fixed_reset_state_ids", False,
                  f"true with algorithm.adv_type={adv} (a group must share its reset state)")
        if group % train.group_size:
            _fail("env.train.group_size", train.group_size,
                  f"algorithm.group_size ({group}) or a divisor of it with adv_type={adv} (the envs of an "
                  "advantage group that share a reset state)")
        if (train.total_num_envs // (env_ranks * stages)) % group:
            _fail("env.train.total_num_envs", train.total_num_envs,
                  f"a multiple of {env_ranks} env worker(s) x rollout.pipeline_stage_num ({stages}) x "
                  f"algorithm.group_size ({group}): an advantage group lies in one env stage")
    if (key := _offload_setting(cfg, "actor")) and cfg.actor.channel.queue_size:
        _fail("actor.channel.queue_size", cfg.actor.channel.queue_size,
              f"0 (unbounded) with {key}: an offloaded actor takes a step's trajectories only after the whole "
              "rollout")
    window = rollout_window(train)
    if window != train.max_episode_steps and not train.auto_reset:
        _fail("env.train.max_steps_per_rollout_epoch", window, f"null or max_episode_steps ({train.max_episode_steps}) "
              "without env.train.auto_reset (each rollout then starts fresh episodes)")
    samples = train.total_num_envs * chunk_steps(window, chunks) * cfg.algorithm.rollout_epoch
    if samples % cfg.actor.global_batch_size and not POLICY_LOSSES.declared(cfg.algorithm.loss_type)["imitation"]:
        _fail("actor.global_batch_size", cfg.actor.global_batch_size,
              f"a divisor of the {samples} samples a step collects (env.train.total_num_envs x "
              "ceil(max_steps_per_rollout_epoch / num_action_chunks) x algorithm.rollout_epoch)")


def _training_options(cfg: DictConfig, accelerator: str) -> None:
    """Combinations of optimizer, precision and offload options that cannot work."""
    optim, fsdp = cfg.actor.optim, cfg.actor.fsdp_config
    if optim.optimizer == "sgd":
        for key in ("adam_beta1", "adam_beta2", "adam_eps"):
            if optim[key] != schema.default(f"actor.optim.{key}"):
                raise ConfigError(f"actor.optim.{key}: not supported with actor.optim.optimizer=sgd, "
                                  "because SGD keeps no moment estimates")
    if cfg.actor.lr_sched.min_lr > cfg.actor.lr_sched.max_lr:
        _fail("actor.lr_sched.min_lr", cfg.actor.lr_sched.min_lr,
              f"at most actor.lr_sched.max_lr ({cfg.actor.lr_sched.max_lr})")
    if cfg.actor.training_backend == "megatron":
        _megatron_precision(optim, cfg.actor.model.precision)
    gpu = accelerator == "gpu"
    if fsdp.sharding_strategy == "hybrid_shard":
        raise ConfigError("actor.fsdp_config.sharding_strategy: not supported: hybrid_shard, because the actor's "
                          "ranks form one FSDP2 mesh (full_shard shards over all of them, no_shard replicates)")
    if fsdp.grad_scaler.enabled and not (fsdp.amp_autocast.enabled and fsdp.amp_autocast.precision == "fp16"):
        raise ConfigError("actor.fsdp_config.grad_scaler.enabled: not supported here, because loss "
                          "scaling is for fp16 autocast (amp_autocast.enabled with precision fp16)")
    if fsdp.offload_pin_memory and not (gpu and fsdp.cpu_offload):
        raise ConfigError("actor.fsdp_config.offload_pin_memory: not supported here, because pinned "
                          "host memory needs CUDA and actor.fsdp_config.cpu_offload")
    if fsdp.cpu_offload and {"weight", "optimizer"} & set(offloaded_parts(cfg, "actor")):
        # (the parts are listed weight, optimizer, grad: the key named turns on one that moves)
        raise ConfigError(f"{_offload_setting(cfg, 'actor')}: not supported with actor.fsdp_config.cpu_offload, "
                          "because the actor's state already lives in host memory")


def _megatron_precision(optim: DictConfig, precision: str) -> None:
    """Megatron's mixed precision: the flag names the model's dtype; the loss scale is fp16's."""
    if optim.fp16 and optim.bf16:
        raise ConfigError("actor.optim.fp16 and actor.optim.bf16 both true: set one")
    for dtype in ("fp16", "bf16"):
        if optim[dtype] and precision != dtype:
            _fail(f"actor.optim.{dtype}", True, f"actor.model.precision {dtype} with it (the model's parameters; "
                  f"the optimizer's main weights are fp32), not {precision}")
    if optim.loss_scale is not None and not optim.fp16:
        raise ConfigError("actor.optim.loss_scale: not supported here, because losses are scaled for fp16 "
                          "(actor.optim.fp16)")
    if optim.loss_scale_window != schema.default("actor.optim.loss_scale_window") \
            and not (optim.fp16 and optim.loss_scale is None):
        raise ConfigError("actor.optim.loss_scale_window: not supported here, because only a dynamic fp16 loss "
                          "scale has a window (actor.optim.fp16 with actor.optim.loss_scale null)")


def _offload_setting(cfg: DictConfig, role: str) -> str | None:
    """The key that makes ``role`` offload between phases; None when it stays resident."""
    if cfg[role].enable_offload:
        return f"{role}.enable_offload"
    parts = offloaded_parts(cfg, role)
    return f"{role}.offload_{parts[0]}" if parts else None


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
    """The policy's own checks of the folders its options name (``Policy.check_config``): a
    folder that does not fit the config fails here, before any worker starts."""
    try:
        POLICIES.get(model.model_type).check_config(OmegaConf.to_container(model, resolve=True))
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


def _fail(key: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{key} = {value!r}: expected {expected}")


# The run's arithmetic: what the checks above hold, as the runner and the workers compute it.

def replicas(cfg: Any) -> int:
    """Actor ranks that train on the same samples (a tensor-parallel group), 1 with FSDP."""
    return cfg.actor.model.tensor_model_parallel_size if cfg.actor.training_backend == "megatron" else 1


def training_steps(runner_cfg: Any) -> int:
    """Training steps of a run: ``runner.max_steps`` when set (> 0), else ``runner.max_epochs``."""
    return runner_cfg.max_steps if runner_cfg.max_steps > 0 else runner_cfg.max_epochs


def rollout_window(env_cfg: Any) -> int:
    """Env steps per env in one rollout of this env split: ``max_steps_per_rollout_epoch`` for
    training when set, else one episode's ``max_episode_steps``."""
    return env_cfg.get("max_steps_per_rollout_epoch") or env_cfg.max_episode_steps


OFFLOAD_PARTS = ("weight", "optimizer", "grad")


def offloaded_parts(cfg: DictConfig, role: str) -> tuple[str, ...]:
    """What ``role`` frees while it idles between phases: for the actor the parts
    ``actor.offload_weight`` / ``offload_optimizer`` / ``offload_grad`` name (all three with
    ``enable_offload``); for the env and rollout roles everything (``("all",)``) with
    ``enable_offload``. Empty: it stays resident."""
    section = cfg[role]
    if role != "actor":
        return ("all",) if section.enable_offload else ()
    if section.enable_offload:
        return OFFLOAD_PARTS
    flags = {"weight": section.offload_weight, "optimizer": section.offload_optimizer, "grad": section.offload_grad}
    return tuple(part for part in OFFLOAD_PARTS if flags[part])


def chunk_steps(max_episode_steps: int, num_action_chunks: int) -> int:
    """Chunk steps of an episode: enough whole chunks for ``max_episode_steps`` env steps. When
    the limit is not a multiple of the chunk (LIBERO-Spatial's 220 with chunks of 8), the env
    truncates the episode inside its last chunk and the rest of that chunk is ignored."""
    return -(-max_episode_steps // num_action_chunks)
