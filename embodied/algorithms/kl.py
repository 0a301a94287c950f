"""Per-token estimators of KL(pi || pi_ref) from log-probs of actions sampled by pi.

``algorithm.kl_penalty_type`` picks one (see http://joschu.net/blog/kl-approx.html for the
k1/k2/k3 naming); ``algorithm.kl_beta`` weighs the aggregated result in the actor loss.
With ``log_ratio = logprob - ref_logprob``:

- ``kl`` (k1): ``log_ratio`` -- unbiased, but single samples can be negative;
- ``abs``: ``|log_ratio|``;
- ``mse`` (k2): ``log_ratio ** 2 / 2`` -- low variance, biased;
- ``low_var_kl`` (k3): ``exp(-log_ratio) + log_ratio - 1`` -- unbiased and never negative.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.errors import expected

# k3 grows like exp(-log_ratio): one token far off the reference would swamp the mean.
_LOW_VAR_KL_MAX = 10.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_penalty_type: str) -> Tensor:
    """Elementwise KL estimate, same shape as ``logprobs``; gradients flow through ``logprobs``."""
    log_ratio = logprobs - ref_logprobs
    if kl_penalty_type == "kl":
        return log_ratio
    if kl_penalty_type == "abs":
        return log_ratio.abs()
    if kl_penalty_type == "mse":
        return 0.5 * log_ratio.square()
    if kl_penalty_type == "low_var_kl":
        return (torch.exp(-log_ratio) + log_ratio - 1.0).clamp(max=_LOW_VAR_KL_MAX)
    raise expected("algorithm.kl_penalty_type", kl_penalty_type, f"one of {list(KL_ESTIMATORS)}")


KL_ESTIMATORS = ("kl", "low_var_kl", "abs", "mse")
