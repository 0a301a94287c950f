"""Errors a user can cause and fix. Each message names the key, file or value and what was
expected; the CLI turns a ``ConfigError`` into one line and exit code 2, before workers start
where the check is cheap."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value, file or folder that cannot work; the message says which and why."""


class CheckpointError(ConfigError):
    """A checkpoint folder that does not match the model; the message names files and keys."""


class EnvSetupError(ConfigError):
    """An env config or system part an env cannot use; the message says how to fix it."""


class DataError(EnvSetupError):
    """A data file that cannot be used; the message names the file, line and key."""


def expected(key: str, value: Any, what: str) -> ConfigError:
    """``<key> = <value>: expected <what>``, the shape of every rule's message."""
    return ConfigError(f"{key} = {value!r}: expected {what}")


class ProcessDied(RuntimeError):
    """Not a user's mistake: a process that a worker runs (an env worker's simulator process) is
    gone. The worker raises it so that the runner treats the worker as dead, as when its own
    process dies (``signal``: the signal that killed it, e.g. ``SIGKILL``, when one did)."""

    def __init__(self, message: str, signal: str | None = None) -> None:
        super().__init__(message)
        self.signal = signal

    def __reduce__(self):  # Ray pickles it from the worker to the driver
        return ProcessDied, (str(self), self.signal)
