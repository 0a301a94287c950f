"""Compose a Hydra config from ``config/``, check it against the schema (``embodied.schema``) and
resolve it; and build what a config names (a policy, one env group) with the schema's rules
checked first. Semantic rules (ranges, divisibility, placement) live in ``embodied.validate``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from core.errors import ConfigError
from embodied import schema
from policies import POLICIES
from policies.base import Policy

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("runner.max_steps", "runner.max_epochs")


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
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = _hydra_compose(Path(config_dir or schema.CONFIG_DIR), config_name, overrides)
    except (HydraException, OmegaConfBaseException) as err:
        missing = re.match(r"Could not override '(actor\.model\.[\w.]+)'", str(err))
        if missing:  # a key of other models' files (hydra would suggest appending it with +)
            schema.other_models_key(missing.group(1), None)
        raise ConfigError(f"{config_name}: {_one_line(err)}") from None
    schema.check_schema(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve {_one_line(err)}") from None
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def load_env_config(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """One group file of ``config/env`` composed on its own (with its defaults), for tests,
    benchmarks and scripts that run an env without a whole experiment config."""
    return _hydra_compose(schema.CONFIG_DIR / "env", name, overrides)


def _hydra_compose(directory: Path, config_name: str, overrides: Sequence[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def build_policy(model_cfg: Mapping[str, Any]) -> Policy:
    """The policy named by ``model_cfg.model_type``, built from the ``actor.model`` options once
    the schema's rules accept them."""
    options = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    if "model_type" not in options:
        raise KeyError(f"actor.model.model_type is missing; expected one of {POLICIES.names()}")
    cls = POLICIES.get(options["model_type"])
    schema.check(options, "actor.model.", options["model_type"])
    return cls(options)


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
