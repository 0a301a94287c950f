"""Name -> implementation registries, for every choice a config makes by name (``env_type``,
``model_type``, ``algorithm.adv_type``, ...).

An entry is either a ``"module:attr"`` string, imported on first use (choosing an MLP policy never
imports transformers, choosing the text env never imports a simulator), or an object registered
by decorator beside its definition. Entries carry declarations (``needs_value_head=True``, ...)
that the code choosing them reads without importing the implementation.

Every entry may declare ``reads``: the config keys that choosing it makes the run read, each
with what it sets. A key that only other entries declare does nothing under this choice, so the
config layer refuses it when set (``unread``), naming the entries that would read it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from core.errors import ConfigError


def load(target: str) -> Any:
    """The object a ``"module:attr"`` string names, imported now."""
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


class UnknownName(ConfigError, KeyError):
    """A name no entry has (a ``KeyError`` too, for code that looks names up)."""

    __str__ = ConfigError.__str__  # the message as written, not KeyError's quoted repr


class Registry:
    """Maps the names a config key accepts to implementations and their declarations."""

    def __init__(self, kind: str, config_key: str, entries: dict[str, str] | None = None, **defaults: Any):
        self.kind = kind
        self.config_key = config_key
        self._defaults = {"reads": {}, **defaults}  # declarations every entry has unless it says otherwise
        self._entries: dict[str, Any] = {}
        self._declared: dict[str, dict[str, Any]] = {}
        for name, target in (entries or {}).items():
            self.add(name, target)

    def add(self, name: str, target: Any, **declared: Any) -> None:
        unknown = set(declared) - set(self._defaults)
        if unknown:
            raise TypeError(f"{self.kind} {name!r} declares {sorted(unknown)}; {self.kind}s declare {sorted(self._defaults)}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = target
        self._declared[name] = {**self._defaults, **declared}

    def register(self, name: str, **declared: Any) -> Callable[[Any], Any]:
        """Decorator: ``@ADVANTAGES.register("gae", needs_value_head=True)`` above a function."""
        def decorate(target: Any) -> Any:
            self.add(name, target, **declared)
            return target
        return decorate

    def names(self) -> list[str]:
        """In the order of registration (the order error messages list them)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def _check(self, name: Any) -> None:
        if name not in self._entries:
            raise UnknownName(f"unknown {self.kind} {name!r} for {self.config_key}; expected one of {self.names()}")

    def get(self, name: str) -> Any:
        """The implementation named ``name`` (imported now if given as ``"module:attr"``)."""
        self._check(name)
        target = self._entries[name]
        if isinstance(target, str):
            target = self._entries[name] = load(target)
        return target

    def declared(self, name: str) -> dict[str, Any]:
        """What entry ``name`` declares, without importing it."""
        self._check(name)
        return dict(self._declared[name])

    def reads(self, name: str) -> dict[str, str]:
        """The config keys entry ``name`` reads, each with what it sets."""
        return self.declared(name)["reads"]

    def unread(self, name: str) -> dict[str, str]:
        """Keys that other entries read and ``name`` does not, with why setting them does nothing."""
        mine = self.reads(name)
        out: dict[str, str] = {}
        for other in self.names():
            for key, what in self._declared[other]["reads"].items():
                if key not in mine and key not in out:
                    readers = [n for n in self.names() if key in self._declared[n]["reads"]]
                    out[key] = (f"{self.config_key} {name} does not read it ({' or '.join(readers)} "
                                f"{'does' if len(readers) == 1 else 'do'}: {what})")
        return out

    def where(self, **declared: Any) -> list[str]:
        """The names whose declarations have these values."""
        return [n for n in self.names() if all(self._declared[n].get(k) == v for k, v in declared.items())]
