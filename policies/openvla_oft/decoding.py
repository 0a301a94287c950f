"""Choosing action tokens: OFT's one-pass parallel decoding and a token-by-token decoder.

Sampling is Gumbel-max over the temperature/top-k warped distribution, so one noise tensor
``[B, N, n_bins]`` fixes every draw: two decoders given the same noise and the same logits pick
the same tokens, which is how the test compares parallel and sequential decoding with sampling.

``sequential_decode`` runs one Llama step per token with a KV cache and a causal mask. Fed zero
slots it reproduces what ``parallel_decode(causal=True)`` computes in one pass; fed the sampled
tokens it is classic autoregressive decoding (original OpenVLA), the benchmark's baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from policies.openvla_oft.model import OpenVLAOFT, PromptInputs, position_ids


@dataclass(frozen=True)
class ActionSampler:
    """The policy's action distribution: ``softmax(top_k(logits / temperature))`` over the bins.

    Greedy mode takes the argmax, but log-probs are still reported under that distribution, so
    a greedy rollout and a later ``evaluate`` agree.
    """

    do_sample: bool
    temperature: float = 1.0
    top_k: int = 0

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        scaled = logits.float() / self.temperature
        if 0 < self.top_k < scaled.shape[-1]:
            kth = scaled.topk(self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        return torch.log_softmax(scaled, dim=-1)

    @staticmethod
    def entropy(log_probs: torch.Tensor) -> torch.Tensor:
        """Entropy from ``log_probs`` (the output of ``log_probs``; bins cut by top-k count 0)."""
        p = log_probs.exp()
        return -torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(-1)

    def gumbel(
        self, shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        u = torch.rand(shape, device=device, generator=generator).clamp_(1e-20, 1.0 - 1e-7)
        return -torch.log(-torch.log(u))

    def choose(self, logits: torch.Tensor, gumbel: torch.Tensor | None = None) -> torch.Tensor:
        """Slot index per position; ``gumbel`` (same shape as logits) is drawn when not given."""
        if not self.do_sample:
            return logits.argmax(-1)
        if gumbel is None:
            gumbel = self.gumbel(tuple(logits.shape), logits.device)
        return (self.log_probs(logits) + gumbel).argmax(-1)


@dataclass
class Decoded:
    slots: torch.Tensor  # [B, N] chosen bin slot (token id - first action token id)
    logits: torch.Tensor  # [B, N, n_bins] float32 logits each token was chosen from
    hidden_before_actions: torch.Tensor | None = None  # [B, H] (parallel decoding only)


def parallel_decode(
    model: OpenVLAOFT,
    inputs: PromptInputs,
    num_tokens: int,
    sampler: ActionSampler,
    *,
    causal: bool = False,
    gumbel: torch.Tensor | None = None,
) -> Decoded:
    """All ``num_tokens`` action tokens from one forward pass (OpenVLA-OFT)."""
    out = model(inputs, num_tokens, causal=causal)
    return Decoded(sampler.choose(out.logits, gumbel), out.logits, out.hidden_before_actions)


@torch.no_grad()
def sequential_decode(
    model: OpenVLAOFT,
    inputs: PromptInputs,
    num_tokens: int,
    sampler: ActionSampler,
    *,
    feed_tokens: bool,
    gumbel: torch.Tensor | None = None,
) -> Decoded:
    """One token per Llama step (KV cache, causal): a prefill, then ``num_tokens - 1`` steps.

    Each step feeds the embedding of the token just chosen (``feed_tokens``) or a zero slot.
    """
    embeds, key_mask = model.prompt_embeddings(inputs)
    b = embeds.shape[0]
    if gumbel is None and sampler.do_sample:
        gumbel = sampler.gumbel((b, num_tokens, model.action_tokenizer.n_bins), embeds.device)
    cache = DynamicCache(config=model.language_model.config)
    hidden = model.language_hidden(embeds, key_mask, position_ids(key_mask), causal=True, cache=cache)
    next_position = key_mask.long().sum(-1, keepdim=True)
    embed_tokens = model.language_model.get_input_embeddings()
    slots, logits = [], []
    for i in range(num_tokens):
        step_logits = model.action_logits(hidden[:, -1])
        slot = sampler.choose(step_logits, None if gumbel is None else gumbel[:, i])
        slots.append(slot)
        logits.append(step_logits)
        if i == num_tokens - 1:
            break
        if feed_tokens:
            step = embed_tokens(model.action_tokenizer.slots_to_tokens(slot))[:, None]
        else:
            step = embeds.new_zeros(b, 1, embeds.shape[-1])
        key_mask = torch.cat([key_mask, key_mask.new_ones(b, 1)], dim=1)
        hidden = model.language_hidden(step, key_mask, next_position + i, causal=True, cache=cache)
    return Decoded(torch.stack(slots, 1), torch.stack(logits, 1))
