"""The critic head of the policies that read a language model's hidden state (OpenVLA-OFT, the
causal LM): an MLP on one hidden state."""

from __future__ import annotations

from torch import Tensor, nn

VALUE_LAST_STD = 0.02  # RL frameworks' value head: a small last layer, so initial values are ~0


class ValueHead(nn.Module):
    """MLP critic on one hidden state; one value per chunk or per action of the chunk.

    Initialized as RL frameworks do for OFT: Kaiming-normal hidden layers, a last layer drawn
    with std 0.02 and no bias, so the first values are near zero."""

    def __init__(self, hidden_size: int, hidden_sizes: tuple[int, ...], out_dim: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = hidden_size
        for h in hidden_sizes:
            layers += [nn.Linear(width, h), nn.GELU()]
            width = h
        layers.append(nn.Linear(width, out_dim, bias=False))
        self.mlp = nn.Sequential(*layers)
        for layer in self.mlp[:-1]:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(layer.bias)
        nn.init.normal_(self.mlp[-1].weight, std=VALUE_LAST_STD)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.mlp(hidden)
