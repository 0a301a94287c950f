"""The check after every weight sync: does the engine score a fixed probe batch as the actor does?

Rollouts sampled from stale weights, or from a base whose LoRA adapter never arrived, look like
a working run that learns nothing (veRL #7495, #3516; TRL #5975). So after each sync the engine
computes the log-probs of a fixed probe batch (prompt + response token ids) and they are compared
with the actor's own; a gap above the tolerance stops the run (``SyncMismatchError``).

Both sides score at temperature 1, the model itself (``Policy.probe_logprobs``): engines report
prompt log-probs before any temperature (vLLM and SGLang alike), and a weight mismatch shows at any
temperature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from policies.base import ActOutput

# Largest per-token gap that still counts as the same weights, by the engine's dtype (the actor's
# forward is the reference). Measured with vLLM on the CPU: fp32 gaps stay below 3e-4 (0.3M to
# 100M parameters); a bf16 engine differs from a bf16 or fp32 actor by 0.008 to 0.03 on the tiny
# math model, more as layers add up. fp16 keeps more mantissa bits than bf16 (not measured here).
SYNC_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1, "fp16": 0.05}


class SyncMismatchError(RuntimeError):
    """The engine does not sample the weights the actor trains: the run must stop."""


@dataclass
class ProbeBatch:
    """Fixed prompt + response token ids, in the form the policies use: left-padded prompts
    ``input_ids`` / ``attention_mask`` ``[B, P]``, responses ``actions`` ``[B, 1, L]`` padded
    after EOS and ``response_mask`` ``[B, L]``."""

    input_ids: Tensor
    attention_mask: Tensor
    actions: Tensor
    response_mask: Tensor

    @classmethod
    def from_inputs(cls, forward_inputs: Mapping[str, Tensor], actions: Tensor) -> ProbeBatch:
        """A probe from ``act``'s ``forward_inputs`` and actions (a few rows of a rollout)."""
        return cls(forward_inputs["input_ids"], forward_inputs["attention_mask"], actions,
                   forward_inputs["response_mask"])

    @classmethod
    def from_rollout(cls, out: ActOutput, rows: int = 8) -> ProbeBatch:
        """The first ``rows`` responses of a rollout (``act``'s output), kept for the whole run."""
        return cls.from_inputs({k: v[:rows].clone() for k, v in out.forward_inputs.items()}, out.actions[:rows].clone())

    @property
    def forward_inputs(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "response_mask": self.response_mask}

    def sequences(self) -> list[list[int]]:
        """Each row's prompt and response tokens, without padding."""
        rows = []
        for ids, mask, tokens, keep in zip(self.input_ids, self.attention_mask, self.actions[:, 0], self.response_mask):
            rows.append(ids[mask.bool()].tolist() + tokens[keep.bool()].tolist())
        return rows


def sync_gap(engine: Tensor, actor: Tensor, response_mask: Tensor) -> float:
    """The largest per-token log-prob gap over the probe's response tokens."""
    keep = response_mask.bool().reshape(engine.shape)
    return float((engine - actor.reshape(engine.shape)).abs()[keep].max()) if keep.any() else 0.0
