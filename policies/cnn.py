"""Small CNN actor-critic for camera images (``obs["main_images"] [B, H, W, 3] uint8``) plus,
optionally, state (``obs["states"] [B, state_dim]``).

A conv encoder (ReLU, Nature-DQN-like strides by default) and a linear state encoder feed a
shared feature vector; actor and critic MLPs branch from it, so the critic's gradient also
shapes the image features, as in ManiSkill's rgb PPO baseline. Images stay uint8 in
``forward_inputs`` (4x smaller to store and ship) and are scaled to [0, 1] in the forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution

from core.description import EnvDescription
from core.errors import ConfigError
from policies.action_heads import layer_init, mlp
from policies.actor_critic import SmallActorCritic, obs_tensor
from policies.base import model_option


class CNNPolicy(SmallActorCritic):
    config_keys = ("image_size", "conv_channels", "conv_kernels", "conv_strides", "image_feature_dim",
                   "state_feature_dim")
    checkpoint_keys = (*SmallActorCritic.checkpoint_keys, *config_keys, "state_dim", "hidden_dims",
                       "action_distribution", "n_action_bins")

    @classmethod
    def check_env(cls, cfg: Mapping[str, Any], env: EnvDescription, split: str) -> None:
        super().check_env(cfg, env, split)
        if env.image_keys is not None and "main_images" not in env.image_keys:
            raise ConfigError(f"env.{split}: model_type cnn reads obs['main_images'] but {env.label or 'the env'} "
                              "gives no camera images (an obs_mode with cameras, e.g. init_params.obs_mode=rgb)")

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__(cfg)
        height, width = (int(x) for x in model_option(cfg, "image_size"))
        self.image_shape = (height, width, 3)
        self.state_dim = int(model_option(cfg, "state_dim"))
        channels = [int(c) for c in model_option(cfg, "conv_channels")]
        kernels = [int(k) for k in model_option(cfg, "conv_kernels")]
        strides = [int(s) for s in model_option(cfg, "conv_strides")]
        if not (len(channels) == len(kernels) == len(strides) >= 1):
            raise ValueError(
                "actor.model.conv_channels, conv_kernels and conv_strides must be lists of one "
                f"equal length >= 1, got {channels}, {kernels}, {strides}"
            )

        convs: list[nn.Module] = []
        in_channels = 3
        for out_channels, kernel, stride in zip(channels, kernels, strides):
            convs += [layer_init(nn.Conv2d(in_channels, out_channels, kernel, stride)), nn.ReLU()]
            in_channels = out_channels
        convs.append(nn.Flatten())
        convs = nn.Sequential(*convs)
        try:
            with torch.no_grad():
                flat = convs(torch.zeros(1, 3, height, width)).shape[1]
        except RuntimeError as err:
            raise ValueError(
                f"actor.model.image_size {[height, width]} is too small for the conv stack "
                f"(kernels {kernels}, strides {strides})"
            ) from err
        image_features = int(model_option(cfg, "image_feature_dim"))
        self.image_encoder = nn.Sequential(convs, layer_init(nn.Linear(flat, image_features)), nn.ReLU())
        features = image_features
        if self.state_dim > 0:
            state_features = int(model_option(cfg, "state_feature_dim"))
            self.state_encoder = nn.Sequential(layer_init(nn.Linear(self.state_dim, state_features)), nn.ReLU())
            features += state_features

        self.actor = mlp(features, self.hidden_dims, nn.ReLU)
        self.action_head = self._make_action_head(cfg)
        if self.add_value_head:
            self.value_head = nn.Sequential(mlp(features, self.hidden_dims, nn.ReLU), self._value_output())

    def preprocess(self, obs: Mapping[str, Any]) -> dict[str, Tensor]:
        inputs = {"main_images": obs_tensor(obs, "main_images", self.image_shape, torch.uint8, self.device)}
        if self.state_dim > 0:
            inputs["states"] = obs_tensor(obs, "states", (self.state_dim,), torch.float32, self.device)
        return inputs

    def critic_features(self, inputs: Mapping[str, Tensor]) -> Tensor:
        return self.features(inputs)

    def features(self, inputs: Mapping[str, Tensor]) -> Tensor:
        images = inputs["main_images"].permute(0, 3, 1, 2).float() / 255.0
        parts = [self.image_encoder(images)]
        if self.state_dim > 0:
            parts.append(self.state_encoder(inputs["states"]))
        return torch.cat(parts, dim=-1)

    def distribution_and_values(self, inputs: Mapping[str, Tensor]) -> tuple[Distribution, Tensor | None]:
        features = self.features(inputs)
        dist = self.action_head(self.actor(features))
        values = self._values(self.value_head(features)) if self.add_value_head else None
        return dist, values
