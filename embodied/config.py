"""Compose a Hydra config, check it against the schema in ``config/``, and resolve it.

``config/base.yaml`` is the schema of the whole tree (with ``env/base.yaml`` for each of
``env.train`` / ``env.eval`` and ``model/base.yaml`` plus ``model/<model_type>.yaml`` for
``actor.model``): a key that is not there is an error, and a value must have the type of its
default. Semantic rules (ranges, divisibility, placement) live in ``embodied.validate``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("runner.max_steps", "runner.max_epochs")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"

# Nodes whose keys are free: placement lines and simulator construction options, checked by
# the placement parser and by the env adapters themselves.
OPEN_NODES = ("cluster.component_placement", "env.train.init_params", "env.eval.init_params",
              "env.eval_pass_k.init_params")


class ConfigError(ValueError):
    """A user-fixable config mistake; the message names the key, its value and what was expected."""


def register_resolvers() -> None:
    """Arithmetic resolvers used by the configs (``${subtract:a,b}`` and friends), and
    ``${if_null:a,b}`` (``a`` unless it is null)."""
    resolvers = {
        "subtract": lambda a, b: a - b,
        "multiply": lambda a, b: a * b,
        "int_div": lambda a, b: int(a) // int(b),
        "add": lambda a, b: a + b,
        "if_null": lambda a, b: b if a is None else a,
    }
    for name, fn in resolvers.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)


def compose(
    config_name: str, overrides: Sequence[str] = (), config_dir: str | Path | None = None
) -> DictConfig:
    """Hydra composition of ``config_name`` with command-line style overrides, schema-checked
    and fully resolved. Every failure is a ``ConfigError``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()
    directory = Path(config_dir or CONFIG_DIR).resolve()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        missing = re.match(r"Could not override '(actor\.model\.[\w.]+)'", str(err))
        if missing:  # a key of other models' files (hydra would suggest appending it with +)
            _other_models_key(missing.group(1), None)
        raise ConfigError(f"{config_name}: {_one_line(err)}") from None
    finally:
        GlobalHydra.instance().clear()
    check_schema(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve {_one_line(err)}") from None
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def check_schema(cfg: DictConfig, config_dir: Path = CONFIG_DIR) -> None:
    """Every key of ``cfg`` exists in the schema, with a value of the default's type."""
    schema = _load(config_dir / "base.yaml")
    env_schema = _load(config_dir / "env" / "base.yaml")
    for split in ("train", "eval", "eval_pass_k"):
        if cfg.get("env", {}).get(split):
            schema["env"][split] = env_schema
    model_type = OmegaConf.select(cfg, "actor.model.model_type", default=None)
    if cfg.get("actor", {}).get("model"):
        model_schema = _load(config_dir / "model" / "base.yaml")
        own = config_dir / "model" / f"{model_type}.yaml"
        if not own.exists():
            known = sorted(p.stem for p in own.parent.glob("*.yaml") if p.stem != "base")
            raise ConfigError(f"actor.model.model_type = {model_type!r}: expected one of {known}")
        model_schema.update(_load(own))
        schema["actor"]["model"] = model_schema
    values = OmegaConf.to_container(cfg, resolve=False)
    _check_node(values, schema, "")


def _load(path: Path) -> dict[str, Any]:
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    data.pop("defaults", None)
    return data


def _check_node(values: dict, schema: dict, prefix: str) -> None:
    for key, value in values.items():
        path = f"{prefix}{key}"
        if path in OPEN_NODES:
            continue
        if key not in schema:
            if prefix == "actor.model.":
                _other_models_key(path, values.get("model_type"))
            near = difflib.get_close_matches(str(key), [str(k) for k in schema], n=1)
            hint = f"; did you mean {prefix}{near[0]}?" if near else ""
            raise ConfigError(f"unknown config key {path}{hint}")
        default = schema[key]
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} = {value!r}: expected a mapping of keys")
            _check_node(value, default, path + ".")
        else:
            _check_type(path, value, default)


def _other_models_key(path: str, model_type: str | None) -> None:
    """A key of other models' schemas set for this one: say so, naming those models."""
    from embodied import schema

    owners = [p.stem for p in sorted((CONFIG_DIR / "model").glob("*.yaml"))
              if p.stem not in ("base", model_type) and path in schema.leaves(p.stem)]
    if owners:
        whose = f"model_type {model_type}" if model_type else "this config's model_type"
        raise ConfigError(f"{path}: not supported by {whose}, because only {', '.join(owners)} read it")


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _check_type(path: str, value: Any, default: Any) -> None:
    if default is None or value is None:  # null is range-checked by embodied.validate
        return
    if _is_interpolation(default) or _is_interpolation(value):
        return
    expected: tuple[type, ...]
    if isinstance(default, bool):
        expected, name = (bool,), "true or false"
    elif isinstance(default, int):
        expected, name = (int,), "an integer"
    elif isinstance(default, float):
        expected, name = (int, float), "a number"
    elif isinstance(default, str):
        expected, name = (str,), "a string"
    elif isinstance(default, list):
        expected, name = (list,), "a list"
    else:
        return
    if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
        raise ConfigError(f"{path} = {value!r}: expected {name}")


def _one_line(err: Exception) -> str:
    """Hydra and OmegaConf spread one error over several lines; keep it to one."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


def training_steps(runner_cfg: Any) -> int:
    """Training steps of a run: ``runner.max_steps`` when set (> 0), else ``runner.max_epochs``."""
    return runner_cfg.max_steps if runner_cfg.max_steps > 0 else runner_cfg.max_epochs


def chunk_steps(max_episode_steps: int, num_action_chunks: int) -> int:
    """Chunk steps of an episode: enough whole chunks for ``max_episode_steps`` env steps. When
    the limit is not a multiple of the chunk (LIBERO-Spatial's 220 with chunks of 8), the env
    truncates the episode inside its last chunk and the rest of that chunk is ignored."""
    return -(-max_episode_steps // num_action_chunks)


def to_yaml(cfg: DictConfig | ListConfig) -> str:
    return OmegaConf.to_yaml(cfg)
