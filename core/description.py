"""What an env config says about its env before any simulator starts: the env adapters describe
it (``envs.describe``), the config layer and the policies check against it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvDescription:
    # every reset state by name (e.g. LIBERO's suite, task and init state); None: unbounded seeds
    reset_state_names: list[str] | None = None
    # where the env fixes the action that opens the gripper: (its key under env.<split>, that value)
    gripper_open_action: tuple[str, int] | None = None
