"""Semantic checks of a composed config, run before Ray or any worker starts.

Each rule raises ``ConfigError`` naming the key, its value and what was expected, so a bad
config costs seconds instead of a crashed cluster.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from omegaconf import DictConfig, OmegaConf

from embodied import checkpoint
from embodied.algorithms.losses import LOSS_AGG_FUNCS
from embodied.config import CONFIG_DIR, ConfigError, chunk_steps
from embodied.placement import PlacementError, PlacementPlan, plan_placement
from embodied.training_options import DTYPES, OPTIMIZERS
from envs import ENV_CHECKS, ENVS
from envs.vector_env import EnvSetupError
from policies import POLICIES

LOGGER_BACKENDS = ("tensorboard", "wandb", "swanlab")
KL_ESTIMATORS = ("kl", "low_var_kl", "abs", "mse")
LEVELS = ("token_level", "action_level", "chunk_level")
CHOICES: dict[str, tuple[str, ...]] = {
    "runner.task_type": ("embodied", "math"),
    "algorithm.adv_type": ("gae", "grpo"),
    "algorithm.bootstrap_at_done": ("truncated", "always"),
    "algorithm.loss_type": ("ppo",),
    "algorithm.loss_agg_func": LOSS_AGG_FUNCS,
    "data.type": ("math",),
    "reward.reward_type": ("math",),
    "actor.tokenizer.tokenizer_type": ("HuggingFaceTokenizer",),
    "algorithm.kl_penalty": KL_ESTIMATORS,
    "algorithm.kl_penalty_type": KL_ESTIMATORS,
    "algorithm.reward_type": ("chunk_level", "action_level"),
    "algorithm.logprob_type": LEVELS,
    "algorithm.entropy_type": LEVELS,
    "rollout.backend": ("huggingface", "sglang", "vllm"),
    "rollout.mode": ("collocate", "disaggregate"),
    "actor.training_backend": ("fsdp", "megatron"),
    "actor.fsdp_config.sharding_strategy": ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard"),
    "actor.lr_sched.lr_decay_style": ("constant", "linear", "cosine"),
    "env.non_finite": ("error", "mask"),
    "actor.optim.optimizer": OPTIMIZERS,
    "actor.fsdp_config.mixed_precision.param_dtype": tuple(DTYPES),
    "actor.fsdp_config.mixed_precision.reduce_dtype": tuple(DTYPES),
    "actor.fsdp_config.amp_autocast.precision": ("bf16", "fp16"),
}
# key: (lowest allowed, whether the bound itself is allowed, highest allowed or None)
RANGES: dict[str, tuple[float, bool, float | None]] = {
    "cluster.num_nodes": (1, True, None),
    "actor.optim.lr": (0, False, None),
    "actor.optim.value_lr": (0, False, None),
    "actor.lr_sched.max_lr": (0, False, None),
    "actor.lr_sched.min_lr": (0, True, None),
    "actor.lr_sched.lr_warmup_init": (0, True, None),
    "actor.lr_sched.lr_warmup_fraction": (0, True, 1),
    "actor.lr_sched.lr_warmup_iters": (0, True, None),
    "actor.optim.clip_grad": (0, False, None),
    "actor.optim.max_skipped_updates": (1, True, None),
    "actor.optim.min_lr": (0, True, None),
    "actor.optim.adam_beta1": (0, True, 1),
    "actor.optim.adam_beta2": (0, True, 1),
    "actor.fsdp_config.grad_scaler.init_scale": (0, False, None),
    "actor.fsdp_config.grad_scaler.growth_interval": (1, True, None),
    "actor.optim.adam_eps": (0, False, None),
    "actor.optim.weight_decay": (0, True, None),
    "actor.micro_batch_size": (1, True, None),
    "actor.global_batch_size": (1, True, None),
    "algorithm.ratio_clip_eps": (0, False, None),
    "algorithm.clip_ratio_low": (0, False, None),
    "algorithm.clip_ratio_high": (0, False, None),
    "algorithm.clip_ratio_c": (1, False, None),
    "algorithm.value_clip": (0, False, None),
    "algorithm.value_loss_coef": (0, True, None),
    "algorithm.gamma": (0, True, 1),
    "algorithm.gae_lambda": (0, True, 1),
    "algorithm.entropy_bonus": (0, True, None),
    "algorithm.kl_beta": (0, True, None),
    "algorithm.early_stop_imp_ratio": (1, False, None),
    "algorithm.target_kl": (0, False, None),
    "algorithm.group_size": (1, True, None),
    "algorithm.rollout_epoch": (1, True, None),
    "algorithm.update_epochs": (1, True, None),
    "algorithm.n_minibatches": (1, True, None),
    "algorithm.sampling_params.temperature": (0, False, None),
    "algorithm.sampling_params.top_p": (0, False, 1),
    "algorithm.sampling_params.top_k": (-1, True, None),  # -1 (or 0): off
    "rollout.pipeline_stage_num": (1, True, None),
    "runner.max_epochs": (1, True, None),
    "runner.seq_length": (1, True, None),
    "data.max_prompt_length": (1, True, None),
    "data.rollout_batch_size": (1, True, None),
    "data.val_rollout_batch_size": (1, True, None),
    "algorithm.logprob_forward_micro_batch_size": (1, True, None),
    "algorithm.sampling_params.repetition_penalty": (0, False, None),
    "algorithm.sampling_params.min_new_tokens": (0, True, None),
    "reward.reward_scale": (0, False, None),
    "actor.model.num_action_chunks": (1, True, None),
    "actor.model.action_dim": (1, True, None),
}
NULLABLE = {
    "algorithm.clip_ratio_low", "algorithm.clip_ratio_high", "algorithm.clip_ratio_c",
    "algorithm.value_clip", "algorithm.target_kl", "data.val_rollout_batch_size",
}
MEGATRON = "a Megatron option, because the Megatron backend is not available (the actor trains with FSDP2)"
FSDP1 = "an FSDP1 option, because the actor runs FSDP2 (fully_shard)"
# Keys of the schema that cannot work here, each with "<what>, because <why>": setting one (or a
# key under one) to anything but its schema default stops the command before anything starts
# with "<key>: not supported: <what>, because <why>".
REFUSED: dict[str, str] = {
    "actor.training_backend": "megatron, because the Megatron backend is not available (the actor "
                              "trains with FSDP2)",
    "actor.megatron": MEGATRON,
    "actor.mcore_gpt": MEGATRON,
    "actor.spec_name": MEGATRON,
    "actor.offload_optimizer": MEGATRON + "; use actor.fsdp_config.cpu_offload",
    "actor.offload_weight": MEGATRON + "; use actor.fsdp_config.cpu_offload",
    "actor.offload_grad": MEGATRON + "; use actor.fsdp_config.cpu_offload",
    "actor.optim.use_distributed_optimizer": MEGATRON + " (FSDP2 always shards the optimizer state)",
    "actor.optim.overlap_grad_reduce": MEGATRON,
    "actor.optim.overlap_param_gather": MEGATRON,
    "actor.optim.overlap_param_gather_with_optimizer_step": MEGATRON,
    "actor.optim.optimizer_enable_pin": MEGATRON,
    "actor.optim.loss_scale_window": MEGATRON + "; fp16 loss scaling is actor.fsdp_config.grad_scaler",
    "actor.optim.bf16": MEGATRON + "; use actor.fsdp_config.amp_autocast or mixed_precision",
    "actor.optim.fp16": MEGATRON + "; use actor.fsdp_config.amp_autocast or mixed_precision",
    "actor.enable_dp_load_balance": MEGATRON,
    "actor.calculate_flops": "FLOP counting, because it is not implemented",
    "actor.fsdp_config.strategy": "FSDP1, because only FSDP2 (fully_shard) is implemented",
    "actor.fsdp_config.sharding_strategy": "other strategies than full_shard, because FSDP2 always shards "
                                           "fully (reshard_after_forward: false keeps parameters "
                                           "gathered, like shard_grad_op)",
    "actor.fsdp_config.enable_gradient_accumulation": FSDP1 + ", which syncs only the last micro-batch",
    "actor.fsdp_config.forward_prefetch": FSDP1 + ", which prefetches by itself",
    "actor.fsdp_config.limit_all_gathers": FSDP1,
    "actor.fsdp_config.backward_prefetch": FSDP1 + ", which prefetches by itself",
    "actor.fsdp_config.use_orig_params": FSDP1 + ", which always keeps the original parameters",
    "actor.fsdp_config.use_liger_kernel": "Liger kernels, because they need CUDA and no policy uses them",
    "actor.fsdp_config.fsdp_size": "hybrid sharding, because shard groups smaller than the actor "
                                   "are not implemented",
    "actor.fsdp_config.mixed_precision.buffer_dtype": "a buffer dtype, because FSDP2 keeps buffers "
                                                      "in their own dtype",
    "critic.use_critic_model": "a separate critic model, because PPO's critic here is the "
                               "policy's value head (actor.model.add_value_head)",
    "rollout.mode": "choosing the mode, because it follows from cluster.component_placement "
                    "(collocated, disaggregated or hybrid, printed at start)",
    "rollout.channel.name": "a channel of its own, because env, rollout and actor share env.channel.name",
    "actor.channel.name": "a channel of its own, because env, rollout and actor share env.channel.name",
}
ENV_RANGES = {"total_num_envs": 1, "max_episode_steps": 1, "group_size": 1}


def validate(cfg: DictConfig) -> PlacementPlan:
    """Check every rule; return the placement plan the cluster will be launched with."""
    refuse_unsupported(cfg)
    for key, allowed in CHOICES.items():
        _choice(cfg, key, allowed)
    for key, (low, inclusive, high) in RANGES.items():
        if key.startswith("actor.model.") and not cfg.actor.model:
            continue
        _range(cfg, key, low, inclusive, high)

    backends = list(cfg.runner.logger.logger_backends)
    for backend in backends:
        if backend not in LOGGER_BACKENDS:
            _fail("runner.logger.logger_backends", backends, f"backends among {list(LOGGER_BACKENDS)}")

    if cfg.rollout.backend != "huggingface":
        _generation_engine(cfg.rollout.backend)
    if cfg.data.max_prompt_length >= cfg.runner.seq_length:
        _fail("data.max_prompt_length", cfg.data.max_prompt_length,
              f"fewer tokens than runner.seq_length ({cfg.runner.seq_length}), leaving room to generate")

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
    if cfg.runner.only_eval and (cfg.runner.ckpt_path is not None or model.model_path is None):
        _checkpoint(cfg, "runner.ckpt_path")  # without one, eval runs the pretrained actor.model.model_path
    if cfg.runner.resume_dir not in (None, "auto"):
        _checkpoint(cfg, "runner.resume_dir")
    _pass_k(cfg)
    _validate_envs(cfg, plan)
    if "text" in (cfg.env.train.env_type, cfg.env.eval.env_type):
        _validate_text(cfg)
    return plan


def _generation_engine(backend: str) -> None:
    import importlib.util

    if importlib.util.find_spec(backend) is None:
        _fail("rollout.backend", backend, f"huggingface: the {backend} engine is not installed "
              "(it needs CUDA); generation runs on Hugging Face generate")
    _fail("rollout.backend", backend, f"huggingface: no {backend} adapter exists yet "
          "(generation runs on Hugging Face generate)")


def _validate_text(cfg: DictConfig) -> None:
    """Text envs (math): the causal LM, its tokenizer and the prompt sets, read once here so that
    a missing folder, a malformed line or a missing key fails before any worker starts."""
    from envs.text import DataError, load_prompts, load_tokenizer

    model, tokenizer = cfg.actor.model, cfg.actor.tokenizer
    if model.model_type != "causal_lm":
        _fail("actor.model.model_type", model.model_type, "causal_lm with a text env")
    if model.model_path is None or not os.path.isfile(os.path.join(model.model_path, "config.json")):
        _fail("actor.model.model_path", model.model_path, "a Hugging Face model folder (with config.json)")
    if tokenizer.padding_side != "left":
        _fail("actor.tokenizer.padding_side", tokenizer.padding_side,
              "left: prompts are left-padded for batched generation")
    if tokenizer.extra_vocab_size:
        _fail("actor.tokenizer.extra_vocab_size", tokenizer.extra_vocab_size, "0 for causal_lm")
    train = cfg.env.train
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
    """``data.val_pass_k``: a whole number >= 1; above 1 it samples on the ``env.eval_pass_k`` text
    envs, k per prompt."""
    k = cfg.data.val_pass_k
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        _fail("data.val_pass_k", k, "a whole number >= 1 (responses sampled per validation prompt; 1 = off)")
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
        for key, low in ENV_RANGES.items():
            _range(cfg, f"env.{split}.{key}", low, True, None)
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


def refuse_unsupported(cfg: DictConfig) -> None:
    """``REFUSED``: each key (or leaf under it) set to anything but its schema default stops here."""
    schema = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "base.yaml"), resolve=False)
    scratch = OmegaConf.create(OmegaConf.to_container(cfg))  # to resolve defaults such as ${a.b}/c
    for key, why in REFUSED.items():
        default: Any = schema
        for part in key.split("."):
            default = default[part]
        leaves = _leaves(default, key + ".") if isinstance(default, dict) else [(key, default)]
        for path, value in leaves:
            if isinstance(value, str) and "${" in value:
                scratch["_default_"] = value
                value = scratch["_default_"]
            if OmegaConf.select(cfg, path) != value:
                raise ConfigError(f"{path}: not supported: {why}")


def _leaves(node: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in node.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


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
    keep = cfg.runner.max_ckpts_to_keep
    if keep == 0 or keep < -1:
        _fail("runner.max_ckpts_to_keep", keep, "-1 (keep all) or at least 1")


def devices_per_node(cfg: DictConfig) -> tuple[int, str]:
    """Devices on each node and their kind: GPUs where torch sees them, else CPU slots."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    accelerator = "gpu" if gpus else "cpu"
    configured = cfg.cluster.num_gpus_per_node
    if configured is not None:
        if configured < 1:
            _fail("cluster.num_gpus_per_node", configured, "at least 1, or null to detect")
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


def _choice(cfg: DictConfig, key: str, allowed: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, str) and key == "actor.training_backend":
        value = value.lower()
    if value not in allowed:
        _fail(key, value, f"one of {list(allowed)}")


def _range(cfg: DictConfig, key: str, low: float, inclusive: bool, high: float | None) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None and key in NULLABLE:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value >= low if inclusive else value > low) and (high is None or value <= high)
    if not ok:
        bound = f">= {low}" if inclusive else f"> {low}"
        if high is not None:
            bound += f" and <= {high}"
        _fail(key, value, f"a number {bound}")


def _fail(key: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{key} = {value!r}: expected {expected}")
