"""The keys env, rollout and actor workers trade under on the channel, owned here so that both
ends of every queue name it the same way. A key's first part is its queue (``<role>.channel.
queue_name``), which sets its bound (``<role>.channel.queue_size``).

- ``obs_key``: env rank ``e``'s stage ``s`` -> its rollout rank: observations (and the rewards and
  dones of the chunk that led to them);
- ``action_key``: the rollout rank -> env rank ``e``'s stage ``s``: the actions of that chunk;
- ``replay_key``: rollout ranks -> actor rank ``k``: finished trajectories.
"""

from __future__ import annotations

from typing import Any

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.channel.queue_name", "rollout.channel.queue_name", "actor.channel.queue_name",
               "env.channel.queue_size", "rollout.channel.queue_size", "actor.channel.queue_size")


def queue_bounds(cfg: Any) -> dict[str, int]:
    """Each queue of the channel and its bound (0 = unbounded)."""
    return {cfg[role].channel.queue_name: cfg[role].channel.queue_size for role in ("env", "rollout", "actor")}


def obs_key(cfg: Any, split: str, env_rank: int, stage: int) -> str:
    return f"{cfg.env.channel.queue_name}/{split}/{env_rank}/{stage}"


def action_key(cfg: Any, split: str, env_rank: int, stage: int) -> str:
    return f"{cfg.rollout.channel.queue_name}/{split}/{env_rank}/{stage}"


def replay_key(cfg: Any, actor_rank: int) -> str:
    return f"{cfg.actor.channel.queue_name}/{actor_rank}"
