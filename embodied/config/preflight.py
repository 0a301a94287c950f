"""What the driver reads from a training checkpoint before any worker starts.

Every checkpoint carries the resolved config of its run (``config.yaml``, embodied/checkpoint.py).
Evaluating or exporting one (``runner.only_eval`` with ``runner.ckpt_path``) takes the model
settings from it, the ``actor.model`` options its policy says a checkpoint fixes
(``Policy.checkpoint_settings``), over what the config file says; an option the command line
sets to another value is an error naming both, unless the weights do not depend on it
(``Policy.checkpoint_defaults``). Without ``--config-name`` the checkpoint's own
config is the config. Checkpoints written before they carried a config are read as before.

And every checkpoint a run reads (``runner.ckpt_path``, ``runner.resume_dir``) is checked against
the model (``Policy.check_checkpoint``) here, not by a worker half a minute after the start.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from core.errors import ConfigError
from embodied import checkpoint
from policies import POLICIES

MODEL = "actor.model"


def stored_config(overrides: Sequence[str]) -> tuple[str, str] | None:
    """``(config name, folder)`` of the config stored with the checkpoint that a
    ``runner.ckpt_path=...`` among ``overrides`` names; None without one."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "runner.ckpt_path" and value not in ("", "null"):
            step = _resolve(value, "runner.ckpt_path")
            if (step / checkpoint.CONFIG_FILE).is_file():
                return Path(checkpoint.CONFIG_FILE).stem, str(step)
    return None


def run_path_defaults(folder: str) -> list[str]:
    """Overrides giving back their defaults to the keys whose defaults derive from the run's name
    and folder (``${runner.output_dir}/${runner.experiment_name}``, ...), for the config stored in
    ``folder``: it holds them resolved to the training run's folders, which an evaluation named
    otherwise must not write to (and which the refusal of non-default values would take as set)."""
    from embodied.config.schema import CONFIG_DIR

    stored = OmegaConf.load(Path(folder) / checkpoint.CONFIG_FILE)
    refs = ("${runner.output_dir}", "${runner.experiment_name}", "${runner.logger.log_path}")
    derived = []
    for prefix, file in (("", "base.yaml"), ("env.train.", "env/base.yaml"), ("env.eval.", "env/base.yaml")):
        stack = [(prefix, OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / file), resolve=False))]
        while stack:
            path, node = stack.pop()
            for key, value in node.items():
                if isinstance(value, dict):
                    stack.append((f"{path}{key}.", value))
                elif (isinstance(value, str) and any(ref in value for ref in refs)
                      and OmegaConf.select(stored, f"{path}{key}") is not None):
                    derived.append(f"{path}{key}={value}")
    return derived


def given_model_keys(cfg: DictConfig, without: DictConfig | None, overrides: Sequence[str]) -> set[str]:
    """The ``actor.model`` keys the command line sets: those its overrides name, and those whose
    value they change through an interpolation (``runner.max_prompt_length``); ``without`` is the
    config composed without the overrides."""
    given = set()
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if key.startswith(f"{MODEL}.") or key in ("model@actor.model", MODEL):
            given.add(key if key.startswith(f"{MODEL}.") else f"{MODEL}.model_type")
    if without is not None:
        mine, theirs = OmegaConf.to_container(cfg.actor.model), OmegaConf.to_container(without.actor.model)
        given |= {f"{MODEL}.{k}" for k, v in mine.items() if theirs.get(k, v) != v}
    return given


def with_checkpoint_model(cfg: DictConfig, given: set[str]) -> tuple[DictConfig, list[str]]:
    """``cfg`` with the model settings of the checkpoint an evaluation or export reads, and one
    note per option that differs from the config; ``given`` holds the keys the command line set."""
    if not cfg.runner.only_eval or cfg.runner.ckpt_path is None:
        return cfg, []
    step = _resolve(cfg.runner.ckpt_path, "runner.ckpt_path")
    stored = checkpoint.read_config(step)
    if stored is None:  # written before checkpoints carried their config
        return cfg, []
    source = step / checkpoint.CONFIG_FILE
    trained = (stored.get("actor") or {}).get("model") or {}
    kind = trained.get("model_type")
    if kind not in POLICIES:
        raise ConfigError(f"{source}: actor.model.model_type = {kind!r}: expected one of {POLICIES.names()}")
    model = OmegaConf.to_container(cfg.actor.model)
    notes = []
    if model.get("model_type") != kind:  # another model group: the checkpoint's whole
        _refuse_contradiction("model_type", model.get("model_type"), kind, given, step)
        notes.append(f"actor.model: the checkpoint's model_type {kind} (the config has {model.get('model_type')})")
        model = dict(trained)
    policy = POLICIES.get(kind)
    for key, value in policy.checkpoint_settings(trained, step / checkpoint.ACTOR_DIR).items():
        if key not in model or model[key] == value or (key in policy.checkpoint_defaults and f"{MODEL}.{key}" in given):
            continue
        _refuse_contradiction(key, model[key], value, given, step)
        notes.append(f"{MODEL}.{key}={value!r} (the config has {model[key]!r})")
        model[key] = value
    if not notes:
        return cfg, []
    cfg = copy.deepcopy(cfg)
    with read_write(cfg), open_dict(cfg):
        cfg.actor.model = model
    return cfg, [f"model settings from {source}: " + "; ".join(notes)]


def check_checkpoints(cfg: DictConfig) -> None:
    """Each checkpoint the run reads against the model, before any worker reads it:
    ``runner.resume_dir`` (a training run goes on from it) and ``runner.ckpt_path`` (evaluated,
    exported, or the weights a training run starts from)."""
    options = OmegaConf.to_container(cfg.actor.model, resolve=True)
    policy = POLICIES.get(options["model_type"])
    for key in ("runner.resume_dir", "runner.ckpt_path"):
        path = OmegaConf.select(cfg, key)
        if path == "auto":
            step = checkpoint.latest(Path(cfg.runner.logger.log_path) / "checkpoints")
        else:
            step = None if path is None else _resolve(path, key)
        if step is None:
            continue
        try:
            policy.check_checkpoint(options, step / checkpoint.ACTOR_DIR, key)
        except ConfigError:
            raise
        except (ValueError, KeyError, OSError, RuntimeError) as err:  # an unreadable file, named
            raise ConfigError(f"{key}: {step / checkpoint.ACTOR_DIR}: {type(err).__name__}: {err}") from None


def _refuse_contradiction(key: str, given_value: Any, trained: Any, given: set[str], step: Path) -> None:
    if f"{MODEL}.{key}" in given:
        raise ConfigError(
            f"{MODEL}.{key} = {given_value!r} (from the command line) contradicts runner.ckpt_path: {step} was "
            f"trained with {MODEL}.{key} = "
            f"{trained!r} ({step / checkpoint.CONFIG_FILE}); leave the override out to use the checkpoint's")


def _resolve(path: str, key: str) -> Path:
    try:
        return checkpoint.resolve(path, key)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
