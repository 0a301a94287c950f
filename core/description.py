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
    # what its observations and actions are, so that a model is checked against them before any
    # worker starts; None where the adapter does not say
    label: str | None = None  # the env in words, for messages (e.g. "ManiSkill PickCube-v1 with robot panda")
    state_dim: int | None = None  # length of obs["states"]
    image_keys: tuple[str, ...] | None = None  # the image observations it gives (main_images, wrist_images)
    wrist_camera_fix: str | None = None  # "<key under env.<split>>=<value>" that adds a wrist camera
    action_dim: int | None = None
    task_descriptions: tuple[str, ...] | None = None  # every instruction its episodes can give
