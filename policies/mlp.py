"""MLP actor-critic for state observations (``obs["states"] [B, state_dim]``).

Actor and critic are separate tanh MLPs, as in CleanRL's continuous PPO and ManiSkill's
state-based PPO baseline: the critic's large early gradients then never disturb the actor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution

from policies.action_heads import mlp
from policies.actor_critic import SmallActorCritic, obs_tensor
from policies.base import model_option


class MLPPolicy(SmallActorCritic):
    checkpoint_keys = (*SmallActorCritic.checkpoint_keys, "state_dim", "hidden_dims", "action_distribution",
                       "n_action_bins")

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__(cfg)
        self.state_dim = int(model_option(cfg, "state_dim"))
        self.actor = mlp(self.state_dim, self.hidden_dims, nn.Tanh)
        self.action_head = self._make_action_head(cfg)
        if self.add_value_head:
            self.value_head = nn.Sequential(mlp(self.state_dim, self.hidden_dims, nn.Tanh), self._value_output())

    def preprocess(self, obs: Mapping[str, Any]) -> dict[str, Tensor]:
        return {"states": obs_tensor(obs, "states", (self.state_dim,), torch.float32, self.device)}

    def critic_features(self, inputs: Mapping[str, Tensor]) -> Tensor:
        return inputs["states"]

    def distribution_and_values(self, inputs: Mapping[str, Tensor]) -> tuple[Distribution, Tensor | None]:
        states = inputs["states"]
        dist = self.action_head(self.actor(states))
        values = self._values(self.value_head(states)) if self.add_value_head else None
        return dist, values
