"""Name -> implementation registries, resolved lazily so that choosing an MLP policy never
imports transformers and choosing the text env never imports a simulator."""

from __future__ import annotations

import importlib
from typing import Any


class Registry:
    """Maps a config name (``env_type``, ``model_type``) to ``"module:attr"``."""

    def __init__(self, kind: str, config_key: str, entries: dict[str, str]):
        self.kind = kind
        self.config_key = config_key
        self._entries = dict(entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise KeyError(
                f"unknown {self.kind} {name!r} for {self.config_key}; "
                f"expected one of {self.names()}"
            )
        module, attr = self._entries[name].split(":")
        return getattr(importlib.import_module(module), attr)
