"""What the driver checks of an OpenVLA-OFT config before any worker starts, from files and the
env's description alone: the folders the options name (``check_folders``), a training
checkpoint's ``actor`` folder (``check_training_checkpoint``) and the env (``check_env``). A
worker would find the same mistakes only after building the model, half a minute later."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from core.description import EnvDescription
from core.errors import CheckpointError, ConfigError, expected
from policies.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS
from policies.openvla_oft import checkpoint
from policies.openvla_oft.action_head import L1RegressionHead
from policies.openvla_oft.config import PolicyOptions
from policies.openvla_oft.normalization import resolve_unnorm_key
from policies.openvla_oft.preprocess import prompt_ids
from policies.openvla_oft.projector import ProprioProjector
from policies.value_head import ValueHead
from policies.weights import check_keys, listing


def check_folders(cfg: Mapping[str, Any]) -> None:
    """When ``model_path`` is set: the options, every file of ``model_path`` (used or refused),
    head and projector shapes, the statistics for ``unnorm_key``, and a ``lora_path`` adapter
    against the base weights."""
    if cfg.get("model_path") is None:
        return
    options = PolicyOptions.from_config(cfg)
    contents = _inspect(options, options.model_path)
    config = checkpoint.read_config(options.model_path)
    hidden, action_dim = config.text_config.hidden_size, int(cfg["action_dim"])
    parts = {}
    with torch.device("meta"):
        if contents.proprio is not None and "fc1.weight" in contents.proprio:
            parts["proprio"] = ProprioProjector(contents.proprio["fc1.weight"].shape[1], hidden)
        if contents.action_head is not None:
            parts["action_head"] = L1RegressionHead(hidden, action_dim)
    for part, module in parts.items():
        check_keys(
            {k: tuple(v.shape) for k, v in module.state_dict().items()},
            {k: tuple(v.shape) for k, v in getattr(contents, part).items()},
            f"{part.replace('_', ' ')} {contents.files[part]} (for actor.model.action_dim={action_dim}, "
            f"hidden size {hidden})",
        )
    proprio_dim = parts["proprio"].fc1.in_features if "proprio" in parts else None
    action_statistics(config.norm_stats, options, action_dim, proprio_dim)
    if options.is_lora and options.lora_path:
        check_adapter_against_base(Path(options.lora_path), contents, options.model_path)


def check_env(cfg: Mapping[str, Any], env: EnvDescription, split: str) -> None:
    """The env against the model: the gripper action, the cameras the model reads, and (with
    ``model_path``) the robot state its proprio projector takes and the prompt tokens of every
    task description under its tokenizer."""
    where = f"env.{split}" + (f" ({env.label})" if env.label else "")
    _check_gripper(cfg, env, split)
    if env.image_keys is not None:
        if "main_images" not in env.image_keys:
            raise ConfigError(f"{where} gives no camera images but model_type openvla_oft reads obs['main_images']")
        views = int(cfg["num_images_in_input"])
        if views > 1 and "wrist_images" not in env.image_keys:
            fix = f"; set env.{split}.{env.wrist_camera_fix}" if env.wrist_camera_fix else ""
            raise ConfigError(f"actor.model.num_images_in_input = {views} needs obs['wrist_images'], a wrist camera, "
                              f"which {where} does not give{fix} (or num_images_in_input=1 for a checkpoint "
                              "trained on the main camera alone)")
    if cfg.get("model_path") is None:
        return
    options = PolicyOptions.from_config(cfg)
    if options.use_proprio and env.state_dim is not None:
        config = checkpoint.read_config(options.model_path)
        key = resolve_unnorm_key(config.norm_stats, options.unnorm_key, options.model_path)
        taken = len(config.norm_stats[key].get("proprio", {}).get("q01", ()))
        if taken != env.state_dim:
            raise ConfigError(
                f"{where} gives obs['states'] of {env.state_dim} dimensions but the proprio projector and "
                f"statistics of actor.model.model_path ({options.model_path}, norm_stats[{key!r}].proprio) take "
                f"{taken} (actor.model.use_proprio=true): the checkpoint was trained on another robot state; "
                "evaluate it on an env that gives that state")
    if env.task_descriptions:
        tokenizer = checkpoint.load_tokenizer(options.model_path)
        tokens, task = max((len(prompt_ids(tokenizer, t)), t) for t in env.task_descriptions)
        if tokens > options.max_prompt_length:
            raise expected("actor.model.max_prompt_length", options.max_prompt_length,
                           f"at least {tokens} (runner.max_prompt_length sets it): the task description {task!r} "
                           f"of {where} takes {tokens} prompt tokens with the tokenizer of {options.model_path}")


def _check_gripper(cfg: Mapping[str, Any], env: EnvDescription, split: str) -> None:
    """The gripper action the policy outputs must be the one that opens the env's gripper,
    where the env fixes it (LIBERO: datasets store the gripper as [0 close, 1 open];
    ``normalize_gripper`` makes that -1/+1 (+1 open) and ``invert_gripper`` flips it)."""
    if env.gripper_open_action is None:
        return
    key, given = env.gripper_open_action
    if not cfg["normalize_gripper"]:
        raise expected("actor.model.normalize_gripper", False, f"true with env.{split} (its gripper takes "
                       "-1/+1; the model predicts the dataset's [0, 1])")
    opens = -1 if cfg["invert_gripper"] else 1
    if given != opens:
        raise expected(f"env.{split}.{key}", given, f"{opens} with actor.model.invert_gripper="
                       f"{cfg['invert_gripper']} (the model's action that opens the gripper)")


def check_training_checkpoint(cfg: Mapping[str, Any], folder: Path, key: str) -> None:
    """A training checkpoint's ``actor`` folder (config key ``key`` names it) against the options,
    what ``OpenVLAOFTPolicy.read_checkpoint`` would refuse in a worker: a LoRA run's adapter
    (``is_lora``, ``lora_rank``, its modules on the base weights) and ``rl_heads.safetensors``, or a
    full run's checkpoint folder ``model/`` (its files, and its weights against ``model_path``'s);
    then the RL tensors (value head, L1 log-std) against the options."""
    if cfg.get("model_path") is None:
        return  # nothing to build the policy from (check_folders' business)
    options = PolicyOptions.from_config(cfg)
    adapter, full = folder / ADAPTER_DIR, folder / checkpoint.FULL_MODEL_DIR
    base = _inspect(options, options.model_path)
    if options.is_lora:
        if not (adapter / ADAPTER_WEIGHTS).is_file():
            hint = (f"; it holds a full fine-tuning run's {checkpoint.FULL_MODEL_DIR}/: set actor.model.is_lora=false"
                    if full.is_dir() else "")
            raise CheckpointError(f"{key}: {adapter / ADAPTER_WEIGHTS} is missing but actor.model.is_lora is "
                                  f"true{hint}")
        rank = _adapter_rank(adapter)
        if rank != options.lora_rank:
            raise expected("actor.model.lora_rank", options.lora_rank,
                           f"{rank}, the rank of the LoRA run in {key}={adapter / ADAPTER_CONFIG}")
        check_adapter_against_base(adapter, base, options.model_path)
        source = folder / checkpoint.RL_HEADS_FILE
        rl = _shapes(source) if source.is_file() else {}
    else:
        if not full.is_dir():
            if adapter.is_dir():
                raise CheckpointError(
                    f"{key}: {adapter} holds a LoRA run's adapter but actor.model.is_lora is false; set "
                    f"actor.model.is_lora=true (actor.model.lora_rank={_adapter_rank(adapter)} as trained)")
            raise CheckpointError(f"{key}: {folder} has neither {ADAPTER_DIR}/ (a LoRA run) nor "
                                  f"{checkpoint.FULL_MODEL_DIR}/ (a full fine-tuning run)")
        try:  # names the file and the key that does not fit
            contents = _inspect(options, full, lora_path=None)
        except CheckpointError as err:
            raise CheckpointError(f"{key}: {err}") from None
        check_keys(base.shapes, contents.shapes, f"{key}: checkpoint {full} (against actor.model.model_path "
                                                 f"{options.model_path})")
        source, rl = full, {k: tuple(v.shape) for k, v in contents.rl_state.items()}
    _check_rl_tensors(cfg, options, rl, f"{key}: {source}")


def _check_rl_tensors(cfg: Mapping[str, Any], options: PolicyOptions, rl: Mapping[str, tuple[int, ...]],
                      source: str) -> None:
    """Value head and log-std tensors as the options build them (``value_head_hidden_sizes``,
    ``value_type``, ``action_dim``)."""
    value = {k for k in rl if k.startswith(checkpoint.VALUE_PREFIX)}
    if value and not options.add_value_head:
        raise CheckpointError(f"{source} holds a value head ({listing(value)}) but actor.model.add_value_head is "
                              "false; set actor.model.add_value_head=true")
    if options.add_value_head and not value:
        raise CheckpointError(f"{source} holds no value head (value_head.*) but actor.model.add_value_head is true: "
                              "the run trained without a critic; set actor.model.add_value_head=false")
    l1 = options.action_head == "l1_regression"
    if (checkpoint.LOG_STD in rl) != l1:
        head = "l1_regression (its L1 head's log-std is there)" if not l1 else "discrete (it has no L1 log-std)"
        raise CheckpointError(f"{source} is a run of another action head: set actor.model.action_head={head}")
    expected_shapes = {checkpoint.LOG_STD: (int(cfg["action_dim"]),)} if l1 else {}
    if options.add_value_head:
        hidden = checkpoint.read_config(options.model_path).text_config.hidden_size
        out = 1 if cfg["value_type"] == "chunk_level" else int(cfg["num_action_chunks"])
        with torch.device("meta"):
            head = ValueHead(hidden, options.value_head_hidden_sizes, out)
        expected_shapes |= {checkpoint.VALUE_PREFIX + k: tuple(v.shape) for k, v in head.state_dict().items()}
    check_keys(expected_shapes, dict(rl), f"{source} (actor.model.value_head_hidden_sizes="
                                          f"{list(options.value_head_hidden_sizes)}, value_type={cfg['value_type']})")


def _inspect(options: PolicyOptions, path: str | Path, **overrides: Any) -> checkpoint.FolderContents:
    kwargs = dict(use_proprio=options.use_proprio, action_head=options.action_head,
                  add_value_head=options.add_value_head, lora_path=options.lora_path) | overrides
    return checkpoint.inspect_folder(path, **kwargs)


def _adapter_rank(adapter: Path) -> int | None:
    try:
        return json.loads((adapter / ADAPTER_CONFIG).read_text()).get("r")
    except (OSError, ValueError):
        raise CheckpointError(f"{adapter / ADAPTER_CONFIG} is missing or not JSON (peft's adapter layout)") from None


def _shapes(file: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(file, "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def action_statistics(
    norm_stats: Mapping[str, Any], options: PolicyOptions, action_dim: int, proprio_dim: int | None
) -> tuple[str, dict, dict | None]:
    """``(unnorm_key, action statistics, proprio statistics)``, checked against the model."""
    source = f"{options.model_path}/{checkpoint.STATS_FILE} (or config.json norm_stats)"
    unnorm_key = resolve_unnorm_key(norm_stats, options.unnorm_key, source)
    stats = norm_stats[unnorm_key]
    if "action" not in stats:
        raise ConfigError(f"{source}: norm_stats[{unnorm_key!r}] has no 'action' statistics")
    action_stats = stats["action"]
    if len(action_stats.get("q01", ())) != action_dim:
        raise ConfigError(
            f"actor.model.action_dim={action_dim} but {source} norm_stats[{unnorm_key!r}].action has "
            f"{len(action_stats.get('q01', ()))} dimensions"
        )
    proprio_stats = None
    if options.use_proprio:
        if "proprio" not in stats:
            raise ConfigError(f"actor.model.use_proprio is true but {source} norm_stats[{unnorm_key!r}] has no 'proprio'")
        proprio_stats = stats["proprio"]
        if proprio_dim is not None and len(proprio_stats.get("q01", ())) != proprio_dim:
            raise ConfigError(
                f"{source} norm_stats[{unnorm_key!r}].proprio has {len(proprio_stats.get('q01', ()))} dimensions "
                f"but the proprio projector in {options.model_path} takes {proprio_dim}"
            )
    return unnorm_key, action_stats, proprio_stats


def check_adapter_against_base(adapter: Path, contents: checkpoint.FolderContents, base_path: str) -> None:
    """Every LoRA tensor of a peft adapter folder must sit on a base weight of matching width:
    ``lora_A`` is ``[r, in]``, ``lora_B`` is ``[out, r]`` for a base weight ``[out, in]``."""
    weights = adapter / ADAPTER_WEIGHTS
    if not (adapter / ADAPTER_CONFIG).exists() or not weights.exists():
        raise CheckpointError(f"actor.model.lora_path={str(adapter)!r} needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    base = dict(contents.shapes)
    for part, prefix in (("proprio", "proprio_projector."), ("action_head", "action_head.")):
        base |= {prefix + k: tuple(v.shape) for k, v in (getattr(contents, part) or {}).items()}
    for key, shape in _shapes(weights).items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        target = base.get(f"{module}.weight")
        if target is None:
            raise CheckpointError(
                f"{weights}: {key} adapts {module}, which the base checkpoint {base_path} has no weight "
                "for: the adapter belongs to another model"
            )
        if len(target) != 2 or len(shape) != 2:
            continue
        ok = shape[1] == target[1] if kind.startswith("A.") else shape[0] == target[0]
        if not ok:
            raise CheckpointError(
                f"{weights}: {key} has shape {shape} but the base weight {module}.weight is {target}: "
                "the adapter was trained on another base model"
            )
