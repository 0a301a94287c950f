"""Environment adapters behind one vector-env interface (see DESIGN.md), by ``env_type``."""

from embodied.registry import Registry

ENVS = Registry("env type", "env.*.env_type", {
    "maniskill": "envs.maniskill:ManiSkillVectorEnv",
    "text": "envs.text:TextEnv",
    "libero": "envs.libero:LiberoVectorEnv",
})
# Checks of an env config that run in the driver before any worker starts (cheap imports only),
# by env type; each returns a description whose ``reset_state_names()`` list the reset states.
ENV_CHECKS = Registry("env type", "env.*.env_type", {
    "libero": "envs.libero:check_config",
    "text": "envs.text:check_config",
})
