"""Compose a Hydra config from ``config/``, check it against the schema (``embodied.config.schema``) and
resolve it; and build what a config names (a policy, one env group) with the schema's rules
checked first. Semantic rules (ranges, divisibility, placement) live in ``embodied.config.validate``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from core.errors import ConfigError
from embodied.config import schema
from policies import POLICIES
from policies.base import Policy


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
    and fully resolved. Every failure is a ``ConfigError`` of one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    directory = Path(config_dir or schema.CONFIG_DIR)
    try:
        cfg = hydra_compose(directory, config_name, overrides)
    except (HydraException, OmegaConfBaseException) as err:
        if str(err).startswith("Cannot find primary config"):
            raise ConfigError(_no_such_config(config_name, directory)) from None
        missing = re.match(r"Could not override '([\w.]+)'", str(err))
        if missing:  # hydra would suggest appending it with +: say what is wrong with the key instead
            _unknown_override(missing.group(1), config_name, overrides, directory)
        raise ConfigError(f"{config_name}: cannot compose: {cause(err)}") from None
    schema.check_schema(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve {one_line(err)}") from None
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _unknown_override(key: str, config_name: str, overrides: Sequence[str], directory: Path) -> None:
    """An override of a key the config lacks: raise the schema's own message for it (``unknown
    config key ...; did you mean ...?``, or which models read it), found by composing once more
    with the key appended. A key the schema allows there (a simulator option) keeps Hydra's
    message."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if key.startswith("actor.model."):
        schema.other_models_key(key, None)
    appended = [f"+{o}" if o.split("=", 1)[0] == key else o for o in overrides]
    try:
        retried = hydra_compose(directory, config_name, appended)
    except (HydraException, OmegaConfBaseException):
        return
    schema.check_schema(retried)


def _no_such_config(config_name: str, directory: Path) -> str:
    """A config name that is not there, with the closest experiment files of that folder and
    of the shipped ones."""
    names = sorted({p.stem for d in (directory, schema.CONFIG_DIR) for p in Path(d).glob("*.yaml")} - {"base"})
    close = difflib.get_close_matches(config_name, names, n=3, cutoff=0.5)
    if close:
        return f"no config named {config_name!r} in {directory}; did you mean {', '.join(close)}?"
    return f"no config named {config_name!r} in {directory}; the configs are: {', '.join(names)}"


def load_env_config(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """One group file of ``config/env`` composed on its own (with its defaults), for tests,
    benchmarks and scripts that run an env without a whole experiment config."""
    return hydra_compose(schema.CONFIG_DIR / "env", name, overrides)


def hydra_compose(directory: Path, config_name: str, overrides: Sequence[str]) -> DictConfig:
    """Plain Hydra composition from one folder (no schema check, interpolations unresolved)."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with hydra.initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
            return hydra.compose(config_name=config_name, overrides=list(overrides))
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


def one_line(err: Exception) -> str:
    """Hydra and OmegaConf spread one error over several lines; keep it to one."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


def cause(err: BaseException) -> str:
    """What a composition error comes down to, in one line: Hydra often raises a bare
    ``ConfigCompositionException`` whose cause (an unset environment variable, a missing group
    file) is only in the exception it chains; Hydra's listing of its search path is left out."""
    while not str(err).strip() and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    text = str(err).split("\n\nConfig search path:")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(err).__name__


def to_yaml(cfg: DictConfig | ListConfig) -> str:
    return OmegaConf.to_yaml(cfg)
