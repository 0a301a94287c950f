"""Environment adapters behind one vector-env interface (see DESIGN.md), by ``env_type``."""

from embodied.registry import Registry

ENVS = Registry("env type", "env.*.env_type", {
    "maniskill": "envs.maniskill:ManiSkillVectorEnv",
    "text": "envs.text:TextEnv",
})
