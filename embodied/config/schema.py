"""The schema: every key a config may set, its default, type and allowed values, read from the
config folder (``CONFIG_DIR``), which this module alone reads as a schema.

``config/base.yaml`` is the schema of the whole tree, with ``env/base.yaml`` for each of
``env.train`` / ``env.eval`` / ``env.eval_pass_k`` and ``model/base.yaml`` plus
``model/<model_type>.yaml`` for ``actor.model``: a key that is not there is an error, and a value
must have the type of its default (``check_schema``).

Allowed values are declared once, in the comment next to each default. A comment that starts
with a rule constrains its key::

    optimizer: adam     # {adam, adamw, sgd} ...       one of these values
    gamma: 0.99         # [0, 1] discount               a number in the interval
    lr: 3.0e-4          # (0, inf) ...                  ( ) excludes the bound, [ ] includes it
    value_clip: 0.2     # (0, inf) or null: ...         and these values too
    max_steps: -1       # [1, inf) or -1: ...

A key whose default is null always accepts null. Rules are read from ``base.yaml`` (keys as
written), ``env/base.yaml`` (``env.<split>.<key>``) and ``model/base.yaml`` + the model's own
file (``actor.model.<key>``, the model's file winning). ``check_rules`` checks every rule of a
config before anything starts (``embodied.config.validate`` calls it), ``check`` those of a
policy's options alone.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError, expected

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
ENV_SPLITS = ("train", "eval", "eval_pass_k")
# Nodes whose keys are free: placement lines and simulator construction options, checked by
# the placement parser and by the env adapters themselves.
OPEN_NODES = ("cluster.component_placement", *(f"env.{split}.init_params" for split in ENV_SPLITS))
_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])")
_CHOICES = re.compile(r"^\{([^}]*)\}")
_OR = re.compile(r"^\s+or ([^\s:;,]+)")
_REFERENCE = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")


class RuleError(ValueError):
    """A malformed rule in a schema file (a bug of the schema, not of a user's config)."""


@dataclass(frozen=True)
class Rule:
    choices: tuple[Any, ...] | None = None
    low: float = -math.inf
    high: float = math.inf
    low_closed: bool = False
    high_closed: bool = False
    also: tuple[Any, ...] = ()  # values allowed besides the choices or interval (null, -1, ...)

    def allows(self, value: Any) -> bool:
        if any(value is a if a is None or isinstance(a, bool) else (value == a and not isinstance(value, bool))
               for a in self.also):
            return True
        if value is None:
            return False
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def allowing(self, value: Any) -> Rule:
        return self if value in self.also else Rule(**{**self.__dict__, "also": (*self.also, value)})

    def expected(self) -> str:
        """What the rule allows, for error messages."""
        if self.choices is not None:
            text = f"one of {list(self.choices)}"
        else:
            bounds = [f"{'>=' if self.low_closed else '>'} {_num(self.low)}"] if self.low > -math.inf else []
            if self.high < math.inf:
                bounds.append(f"{'<=' if self.high_closed else '<'} {_num(self.high)}")
            text = "a number " + " and ".join(bounds)
        return text + "".join(f" or {'null' if a is None else a}" for a in self.also)


def parse_rule(comment: str) -> Rule | None:
    """The rule a comment starts with, or None when it starts with prose."""
    text = comment.strip()
    if match := _CHOICES.match(text):
        items = [item.strip() for item in match.group(1).split(",")]
        if not all(items):
            raise RuleError(f"empty choice in {text!r}")
        rule = Rule(choices=tuple(yaml.safe_load(item) for item in items))
    elif match := _INTERVAL.match(text):
        opening, low, high, closing = match.groups()
        try:
            rule = Rule(low=float(low), high=float(high), low_closed=opening == "[", high_closed=closing == "]")
        except ValueError:
            raise RuleError(f"interval bounds must be numbers or inf in {text!r}") from None
        if rule.low > rule.high:
            raise RuleError(f"empty interval {text!r}")
    elif text and text[0] in "[({":
        raise RuleError(f"a comment starting with {text[0]!r} must be a rule: {text!r}")
    else:
        return None
    if alternative := _OR.match(text[match.end():]):
        rule = rule.allowing(yaml.safe_load(alternative.group(1)))
    return rule


@dataclass(frozen=True)
class Leaf:
    default: Any
    rule: Rule | None
    comment: str


def read_leaves(path: Path, prefix: str = "") -> dict[str, Leaf]:
    """Every leaf key of a schema file with its default, rule and comment (a key whose value is
    a mapping is a node, not a leaf; ``{}`` is a leaf filled by a config group)."""
    text = path.read_text()
    lines = text.splitlines()
    out: dict[str, Leaf] = {}

    def walk(node: yaml.MappingNode, at: str) -> None:
        for key_node, value in node.value:
            key = f"{at}{key_node.value}"
            if key_node.value == "defaults" and at == prefix:
                continue
            if isinstance(value, yaml.MappingNode) and value.value:
                walk(value, key + ".")
                continue
            line = lines[value.end_mark.line]
            rest = line[value.end_mark.column:] if value.end_mark.line == key_node.start_mark.line else ""
            comment = rest.split("#", 1)[1] if "#" in rest else ""
            try:
                rule = parse_rule(comment)
            except RuleError as err:
                raise RuleError(f"{path.name} line {key_node.start_mark.line + 1} ({key}): {err}") from None
            default = yaml.safe_load(yaml.serialize(value))
            if rule is not None and default is None:
                rule = rule.allowing(None)
            out[key] = Leaf(default, rule, comment.strip())

    root = yaml.compose(text)
    if root is not None:
        walk(root, prefix)
    return out


@functools.cache
def leaves(model_type: str | None = None, config_dir: Path = CONFIG_DIR) -> dict[str, Leaf]:
    """The whole schema's leaves: base.yaml, env/base.yaml under each split, and the model keys
    of ``model_type`` (all model files' keys together when None)."""
    out = read_leaves(config_dir / "base.yaml")
    for split in ENV_SPLITS:
        out.pop(f"env.{split}", None)
        out |= read_leaves(config_dir / "env" / "base.yaml", f"env.{split}.")
    out.pop("actor.model", None)
    out |= read_leaves(config_dir / "model" / "base.yaml", "actor.model.")
    types = [model_type] if model_type else sorted(p.stem for p in (config_dir / "model").glob("*.yaml")
                                                   if p.stem != "base")
    for name in types:
        if (config_dir / "model" / f"{name}.yaml").exists():
            for key, leaf in read_leaves(config_dir / "model" / f"{name}.yaml", "actor.model.").items():
                kept = out.get(key)  # an own file that only changes the default keeps base's rule
                out[key] = leaf if leaf.rule or kept is None else Leaf(leaf.default, kept.rule, leaf.comment)
    return out


def check(values: Mapping[str, Any], prefix: str, model_type: str | None = None) -> None:
    """Raise ``ConfigError`` naming the first of ``values`` (the keys under ``prefix``, e.g. a
    policy's ``actor.model`` options) that its rule refuses."""
    rules = leaves(model_type)
    for key, value in values.items():
        leaf = rules.get(f"{prefix}{key}")
        if leaf is None or leaf.rule is None or (isinstance(value, str) and "${" in value):
            continue
        if not leaf.rule.allows(value):
            raise expected(f"{prefix}{key}", value, leaf.rule.expected())


def check_rules(cfg: DictConfig) -> None:
    """Every rule of the keys of the env splits and the model this config has."""
    for key, leaf in leaves(OmegaConf.select(cfg, "actor.model.model_type")).items():
        if leaf.rule is None or (key.startswith("actor.model.") and not cfg.actor.model):
            continue
        if key.startswith("env.") and not cfg.env[key.split(".")[1]]:
            continue
        value = OmegaConf.select(cfg, key)
        if not leaf.rule.allows(value):
            raise expected(key, value, leaf.rule.expected())


def choices(key: str) -> tuple[Any, ...]:
    """The allowed values of a choice key."""
    rule = leaves()[key].rule
    if rule is None or rule.choices is None:
        raise KeyError(f"{key} declares no choices in config/")
    return rule.choices


def default(key: str) -> Any:
    """A leaf's default as written (interpolations unresolved)."""
    return leaves()[key].default


# ------------------------------------------------------------------ keys and types
def check_schema(cfg: DictConfig, config_dir: Path = CONFIG_DIR) -> None:
    """Every key of ``cfg`` exists in the schema, with a value of the default's type."""
    schema = _load(config_dir / "base.yaml")
    env_schema = _load(config_dir / "env" / "base.yaml")
    for split in ENV_SPLITS:
        if cfg.get("env", {}).get(split):
            schema["env"][split] = env_schema
    model_type = OmegaConf.select(cfg, "actor.model.model_type", default=None)
    if cfg.get("actor", {}).get("model"):
        model_schema = _load(config_dir / "model" / "base.yaml")
        own = config_dir / "model" / f"{model_type}.yaml"
        if not own.exists():
            raise expected("actor.model.model_type", model_type, f"one of {model_types(config_dir)}")
        model_schema.update(_load(own))
        schema["actor"]["model"] = model_schema
    values = OmegaConf.to_container(cfg, resolve=False)
    _check_node(values, schema, "", schema)


def model_types(config_dir: Path = CONFIG_DIR) -> list[str]:
    """The models that have a schema file (``config/model/<model_type>.yaml``)."""
    return sorted(p.stem for p in (config_dir / "model").glob("*.yaml") if p.stem != "base")


def other_models_key(path: str, model_type: str | None) -> None:
    """A key of other models' schemas set for this one: say so, naming those models."""
    owners = [name for name in model_types() if name != model_type and path in leaves(name)]
    if owners:
        whose = f"model_type {model_type}" if model_type else "this config's model_type"
        raise ConfigError(f"{path}: not supported by {whose}, because only {', '.join(owners)} read it")


def _load(path: Path) -> dict[str, Any]:
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    data.pop("defaults", None)
    return data


def _check_node(values: dict, schema: dict, prefix: str, root: dict) -> None:
    for key, value in values.items():
        path = f"{prefix}{key}"
        if path in OPEN_NODES:
            continue
        if key not in schema:
            if prefix == "actor.model.":
                other_models_key(path, values.get("model_type"))
            near = difflib.get_close_matches(str(key), [str(k) for k in schema], n=1)
            hint = f"; did you mean {prefix}{near[0]}?" if near else ""
            raise ConfigError(f"unknown config key {path}{hint}")
        default = schema[key]
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise expected(path, value, "a mapping of keys")
            _check_node(value, default, path + ".", root)
        else:
            _check_type(path, value, _referenced_default(default, root))


def _referenced_default(default: Any, root: dict) -> Any:
    """The default that a default such as ``${algorithm.sampling_params.do_sample}`` (a plain
    reference, followed through chains) stands for, so that its key's type is checked too; other
    interpolations stay as they are."""
    seen: set[str] = set()
    while isinstance(default, str) and (match := _REFERENCE.match(default)) and match.group(1) not in seen:
        seen.add(match.group(1))
        node: Any = root
        for part in match.group(1).split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        default = node
    return default


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _check_type(path: str, value: Any, default: Any) -> None:
    if default is None or value is None:  # null is range-checked by the rules
        return
    if _is_interpolation(default) or _is_interpolation(value):
        return
    allowed: tuple[type, ...]
    if isinstance(default, bool):
        allowed, name = (bool,), "true or false"
    elif isinstance(default, int):
        allowed, name = (int,), "an integer"
    elif isinstance(default, float):
        allowed, name = (int, float), "a number"
    elif isinstance(default, str):
        allowed, name = (str,), "a string"
    elif isinstance(default, list):
        allowed, name = (list,), "a list"
    else:
        return
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        raise expected(path, value, name)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
