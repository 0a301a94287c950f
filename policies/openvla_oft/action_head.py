"""OpenVLA-OFT's L1-regression action head: an MLP with residual blocks that maps the hidden
states at the action slots to continuous, normalized actions (one forward pass, no sampling).

Parameter names follow the released ``action_head--*.pt`` files (``model.layer_norm1``,
``model.fc1``, ``model.mlp_resnet_blocks.{i}.ffn.{0,1}``, ``model.layer_norm2``, ``model.fc2``:
16 tensors), so those files load as they are once a DDP ``module.`` prefix is removed. The head
reads one action's ``action_dim`` hidden states concatenated (``action_dim * hidden`` inputs)
and predicts that action's ``action_dim`` values.
"""

from __future__ import annotations

import torch
from torch import nn

ACTION_HEAD_BLOCKS = 2


class ResidualBlock(nn.Module):
    """Pre-norm feed-forward block with a skip connection (``ffn`` = LayerNorm, Linear, ReLU)."""

    def __init__(self, dim: int):
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


class ResidualMLP(nn.Module):
    def __init__(self, in_dim: int, hidden: int, out_dim: int, blocks: int = ACTION_HEAD_BLOCKS):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(in_dim)
        self.fc1 = nn.Linear(in_dim, hidden)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(ResidualBlock(hidden) for _ in range(blocks))
        self.layer_norm2 = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionHead(nn.Module):
    def __init__(self, hidden_size: int, action_dim: int):
        super().__init__()
        self.action_dim = action_dim
        self.model = ResidualMLP(hidden_size * action_dim, hidden_size, action_dim)

    def forward(self, action_hidden: torch.Tensor) -> torch.Tensor:
        """``[B, chunks * action_dim, H]`` -> normalized actions ``[B, chunks, action_dim]``."""
        b, n, h = action_hidden.shape
        return self.model(action_hidden.reshape(b, n // self.action_dim, self.action_dim * h))
