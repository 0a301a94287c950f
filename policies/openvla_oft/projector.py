"""MLPs that map other modalities into the LLM's embedding space (names as in the checkpoints)."""

from __future__ import annotations

import torch
from torch import nn


class Projector(nn.Module):
    """Vision patches -> LLM embeddings: a 3-layer MLP for fused backbones, 2 layers otherwise."""

    def __init__(self, fused: bool, vision_dim: int, llm_dim: int):
        super().__init__()
        if fused:
            self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
            self.fc2 = nn.Linear(4 * vision_dim, llm_dim)
            self.fc3 = nn.Linear(llm_dim, llm_dim)
        else:
            self.fc1 = nn.Linear(vision_dim, llm_dim)
            self.fc2 = nn.Linear(llm_dim, llm_dim)
            self.fc3 = None
        self.act = nn.GELU()

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.fc2(self.act(self.fc1(patches)))
        return self.fc3(self.act(x)) if self.fc3 is not None else x


class ProprioProjector(nn.Module):
    """Robot state -> one extra LLM token (OFT stores it in ``proprio_projector--*.pt``)."""

    def __init__(self, proprio_dim: int, llm_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, proprio: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(proprio)))
