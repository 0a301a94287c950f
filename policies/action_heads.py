"""Action distributions of the small policies, and the layer init they share.

Two heads map features to a distribution over a chunk ``[B, C, action_dim]``:

- ``GaussianActionHead`` (``action_distribution: gaussian``): a mean per dim from the
  features and a state-independent log-std parameter. Samples are *not* squashed or clipped:
  the env side clips to its action bounds (ManiSkill's controllers clip normalized actions to
  [-1, 1]), so the stored log-prob is exactly that of the sample and ratios stay exact.
- ``BinnedActionHead`` (``action_distribution: bins``): like a VLA's action tokens, each dim
  is a categorical over ``n_action_bins`` evenly spaced values in [-1, 1] (both ends
  included, so -1, 1 and, for odd counts, 0 are exact).

Init follows CleanRL / ManiSkill's PPO baseline: orthogonal weights with gain sqrt(2) for
hidden layers, a tiny gain for the action output (so the initial policy is centred and its
spread comes from the log-std / near-uniform bins), gain 1 for the value output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Normal

from core.errors import expected
from policies.base import model_option

HIDDEN_GAIN = math.sqrt(2.0)
ACTION_GAIN = 0.01 * math.sqrt(2.0)
VALUE_GAIN = 1.0


def layer_init(layer: nn.Module, gain: float = HIDDEN_GAIN) -> nn.Module:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def mlp(in_dim: int, hidden_dims: Sequence[int], activation: type[nn.Module]) -> nn.Sequential:
    """Hidden layers only, each followed by ``activation``; output width ``hidden_dims[-1]``."""
    layers: list[nn.Module] = []
    for width in hidden_dims:
        layers += [layer_init(nn.Linear(in_dim, width)), activation()]
        in_dim = width
    return nn.Sequential(*layers)


class GaussianActionHead(nn.Module):
    def __init__(self, in_dim: int, num_action_chunks: int, action_dim: int, init_log_std: float):
        super().__init__()
        self.shape = (num_action_chunks, action_dim)
        self.mean = layer_init(nn.Linear(in_dim, num_action_chunks * action_dim), ACTION_GAIN)
        self.log_std = nn.Parameter(torch.full(self.shape, float(init_log_std)))

    def forward(self, features: Tensor) -> Normal:
        mean = self.mean(features).reshape(-1, *self.shape)
        return Normal(mean, self.log_std.exp().expand_as(mean))

    def sample(self, dist: Normal, do_sample: bool) -> Tensor:
        return dist.sample() if do_sample else dist.mean

    def log_prob(self, dist: Normal, actions: Tensor) -> Tensor:
        return dist.log_prob(actions)


class BinnedActionHead(nn.Module):
    def __init__(self, in_dim: int, num_action_chunks: int, action_dim: int, n_action_bins: int):
        super().__init__()
        self.shape = (num_action_chunks, action_dim, n_action_bins)
        self.logits = layer_init(nn.Linear(in_dim, num_action_chunks * action_dim * n_action_bins), ACTION_GAIN)
        self.register_buffer("bin_values", torch.linspace(-1.0, 1.0, n_action_bins), persistent=False)

    def forward(self, features: Tensor) -> Categorical:
        return Categorical(logits=self.logits(features).reshape(-1, *self.shape))

    def sample(self, dist: Categorical, do_sample: bool) -> Tensor:
        tokens = dist.sample() if do_sample else dist.logits.argmax(dim=-1)
        return self.bin_values[tokens]

    def tokens(self, actions: Tensor) -> Tensor:
        """Nearest bin of each action value (exact for values this head produced)."""
        n_bins = self.bin_values.numel()
        return ((actions + 1.0) * 0.5 * (n_bins - 1)).round().long().clamp(0, n_bins - 1)

    def log_prob(self, dist: Categorical, actions: Tensor) -> Tensor:
        return dist.log_prob(self.tokens(actions))


def build_action_head(cfg, in_dim: int, num_action_chunks: int, action_dim: int) -> nn.Module:
    """The head chosen by ``actor.model.action_distribution``."""
    kind = cfg.get("action_distribution")
    if kind == "gaussian":
        return GaussianActionHead(in_dim, num_action_chunks, action_dim, float(model_option(cfg, "init_log_std")))
    if kind == "bins":
        return BinnedActionHead(in_dim, num_action_chunks, action_dim, int(model_option(cfg, "n_action_bins")))
    raise expected("actor.model.action_distribution", kind, f"one of {list(HEADS)}")


HEADS = {"gaussian": "init_log_std", "bins": "n_action_bins"}  # each head and the option only it reads


def unread_head_keys(head: str) -> dict[str, str]:
    """The options of the heads other than ``head``, with why they are not read."""
    why = {"init_log_std": f"the {head} head has no Gaussian std", "n_action_bins": f"the {head} head has no bins"}
    return {f"actor.model.{key}": why[key] for name, key in HEADS.items() if name != head}
