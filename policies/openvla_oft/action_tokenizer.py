"""Continuous actions <-> the LLM's action tokens.

OpenVLA reuses the last ``n_bins`` ids of the tokenizer vocabulary as action tokens: a value in
[-1, 1] is digitized against ``n_bins`` uniform edges (giving 1..n_bins) and token id
``vocab_size - bin``; decoding maps a token back to one of the ``n_bins - 1`` bin centers. The
model side works on the ``n_bins`` action rows only, as "slot" index ``token - first_token_id``.
"""

from __future__ import annotations

import torch


class ActionTokenizer:
    def __init__(self, vocab_size: int, n_bins: int = 256, low: float = -1.0, high: float = 1.0):
        if vocab_size <= n_bins:
            raise ValueError(f"vocab_size {vocab_size} must exceed n_bins {n_bins}")
        self.vocab_size = vocab_size
        self.n_bins = n_bins
        self.low, self.high = low, high
        self.edges = torch.linspace(low, high, n_bins, dtype=torch.float64)
        self.centers = (self.edges[:-1] + self.edges[1:]) / 2
        self.first_token_id = vocab_size - n_bins

    def encode(self, actions: torch.Tensor) -> torch.Tensor:
        """Normalized actions (any shape) -> token ids of the same shape."""
        x = actions.to(torch.float64).clamp(self.low, self.high)
        bins = torch.bucketize(x, self.edges, right=True)  # numpy.digitize semantics: 1..n_bins
        return self.vocab_size - bins

    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> normalized actions (bin centers) as float32."""
        index = (self.vocab_size - token_ids.long() - 1).clamp(0, self.centers.numel() - 1)
        return self.centers.to(token_ids.device)[index].to(torch.float32)

    def slots_to_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.long() + self.first_token_id

    def tokens_to_slots(self, token_ids: torch.Tensor) -> torch.Tensor:
        slots = token_ids.long() - self.first_token_id
        if slots.numel() and (slots.min() < 0 or slots.max() >= self.n_bins):
            raise ValueError(
                f"action token ids must lie in [{self.first_token_id}, {self.vocab_size - 1}]; "
                f"got range [{int(token_ids.min())}, {int(token_ids.max())}]"
            )
        return slots
