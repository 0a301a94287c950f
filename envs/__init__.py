"""Environment adapters behind one env protocol (``envs/protocol.py``), by ``env_type``.

Adding an env is a module implementing the protocol (usually a ``BatchedSim`` under
``VectorEnv``), its line here and its ``config/env/<name>.yaml`` (docs/architecture.md). An entry
declares what the config layer checks without building it: ``describe``, a ``"module:function"``
the driver runs before any worker starts (in seconds: it may build one scene, never rendered),
which checks the env config and returns its ``EnvDescription``; ``task_type``, the
``runner.task_type`` it belongs to; ``reads``, the keys only some envs read, with what they are:
keys outside ``env.*`` that reach it through its group file, and ``env.*.<key>`` of its own split;
``demos``, its demonstrations' ``DemoFormat`` (``envs/demos.py``), read for SFT and recorded by
``python -m embodied.record``; ``concurrent_stages``, whether its env worker steps each pipeline
stage in a thread of its own as soon as its actions come (envs whose steps mostly wait, e.g. on
tools; ``embodied/workers/env.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.description import EnvDescription
from core.errors import EnvSetupError
from core.registry import Registry, load

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("env.*.env_type", "env.*.video_cfg.save_video")

ENVS = Registry("env type", "env.*.env_type", describe=None, task_type="embodied", demos=None,
                concurrent_stages=False)
ORDER = {"env.*.reset_state_order": "the order of a simulator's reset states"}
ENVS.add("libero", "envs.libero:LiberoVectorEnv", describe="envs.libero:describe",
         reads={"env.*.task_suite_name": "the LIBERO suite", **ORDER}, demos="envs.libero_demos:FORMAT")
ENVS.add("maniskill", "envs.maniskill:ManiSkillVectorEnv", describe="envs.maniskill:describe", reads=ORDER,
         demos="envs.maniskill_demos:FORMAT")
ENVS.add("text", "envs.text:TextEnv", describe="envs.text:describe", task_type="math", reads={"data": "prompt data"})
ENVS.add("agent", "envs.agent:AgentEnv", describe="envs.agent:describe", task_type="agent",
         reads={"data": "prompt data"}, concurrent_stages=True)


def describe(env_cfg: Mapping[str, Any]) -> EnvDescription:
    """The checks of ``env_cfg`` that need no simulator, and what they find."""
    target = ENVS.declared(env_cfg["env_type"])["describe"]
    return EnvDescription() if target is None else load(target)(env_cfg)


def make_vector_env(env_cfg: Any, num_envs: int, seed_offset: int = 0, name: str | None = None) -> Any:
    """The env an env worker owns: ``num_envs`` envs of ``env_cfg.env_type``, the first of which
    has global index ``seed_offset``, wrapped in a video recorder when
    ``env_cfg.video_cfg.save_video`` is on (its files start with ``name``)."""
    if not (isinstance(num_envs, int) and num_envs >= 1):
        raise EnvSetupError(f"num_envs={num_envs!r}: expected a positive integer")
    env = ENVS.get(env_cfg["env_type"])(env_cfg, num_envs=num_envs, seed_offset=seed_offset)
    if env_cfg["video_cfg"]["save_video"]:
        from envs.video import VideoRecorder

        try:
            env = VideoRecorder.from_config(env, env_cfg, name=name or f"envs{seed_offset}")
        except BaseException:
            env.close()
            raise
    return env
