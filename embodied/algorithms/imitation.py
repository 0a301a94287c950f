"""Supervised fine-tuning on demonstrations (``algorithm.loss_type: sft``): the negative
log-likelihood of the demonstrated actions under the policy's own head.

The policy says what its head gives (``Policy.imitation``): log-probs of the demonstrated
action tokens (OpenVLA-OFT's discrete head: cross-entropy on the action tokens; the small
policies' bins: the same; their Gaussian head: its NLL per action dim, the log-std trained
with it), or, for a regression head without a likelihood (OpenVLA-OFT's L1-regression head),
point predictions of normalized actions, trained with L1 as OFT trains that head. Either way
``actor/action_l1`` reports the greedy action's mean absolute error against the demonstration.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embodied.algorithms.losses import POLICY_LOSSES


@POLICY_LOSSES.register("sft", imitation=True, reads={"data.demo_paths": "the demonstrations"})
def imitation_loss(logprobs: Tensor | None, predicted: Tensor | None, target: Tensor | None
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """``-mean(logprobs)`` over every action token of the micro-batch when the head gives
    log-probs, else ``mean |predicted - target|``; all inputs ``[N, C, A]``."""
    if logprobs is not None:
        loss = -logprobs.mean()
    elif predicted is not None and target is not None:
        loss = (predicted - target).abs().mean()
    else:
        raise ValueError("an imitation loss needs the demonstrated actions' log-probs, or predictions and targets")
    metrics = {"actor/imitation_loss": loss.detach()}
    if predicted is not None and target is not None:
        with torch.no_grad():
            metrics["actor/action_l1"] = (predicted - target).abs().mean()
    return loss, metrics
