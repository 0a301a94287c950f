"""RL math as small pure torch functions: advantage estimators (``ADVANTAGES``: GAE, GRPO, REINFORCE++), policy
losses (``POLICY_LOSSES``: PPO, and SFT's imitation loss) and the value loss, KL estimators, and how chunked env signals
line up with log-probs (``levels``). Nothing here imports a policy or the config schema."""

from embodied.algorithms.advantages import (
    ADVANTAGES,
    Estimate,
    StepSignals,
    compute_gae,
    episode_returns,
    first_episode_mask,
    grpo_advantages,
    nonuniform_group_mask,
    normalize_advantages,
)
from embodied.algorithms.imitation import imitation_loss
from embodied.algorithms.kl import kl_penalty
from embodied.algorithms.levels import (
    check_levels,
    chunks_to_steps,
    expand_like,
    final_values_to_steps,
    reduce_logprobs,
    steps_to_chunks,
    values_to_steps,
)
from embodied.algorithms.losses import (
    POLICY_LOSSES,
    actor_critic_loss,
    aggregate_loss,
    loss_hyperparameters,
    ppo_policy_loss,
    valid_mask,
    valid_token_weights,
    value_loss,
)

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "Estimate",
    "StepSignals",
    "actor_critic_loss",
    "aggregate_loss",
    "check_levels",
    "chunks_to_steps",
    "compute_gae",
    "episode_returns",
    "expand_like",
    "final_values_to_steps",
    "first_episode_mask",
    "grpo_advantages",
    "imitation_loss",
    "kl_penalty",
    "loss_hyperparameters",
    "nonuniform_group_mask",
    "normalize_advantages",
    "ppo_policy_loss",
    "reduce_logprobs",
    "steps_to_chunks",
    "valid_mask",
    "valid_token_weights",
    "value_loss",
    "values_to_steps",
]
