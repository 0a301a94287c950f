"""``actor.lr_sched``: the learning rate of each training step (warm-up, then decay).

An iteration is one training step (rollout + update), so the schedule is a function of the step
alone and a resumed run continues it exactly. Param groups with their own base rate (the value
head's ``value_lr``) are scaled by the same factor ``lr / max_lr``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from core.errors import expected

# the config keys read here (tests/test_schema.py: every schema key is read or refused)
CONFIG_KEYS = ("actor.lr_sched.lr_warmup_fraction", "actor.lr_sched.lr_warmup_init",
               "actor.lr_sched.lr_warmup_iters", "actor.lr_sched.max_lr", "actor.lr_sched.min_lr",
               "actor.lr_sched.lr_decay_style", "actor.lr_sched.lr_decay_iters")


def learning_rate(step: int, sched: Mapping[str, Any], total_steps: int) -> float:
    """Rate of training step ``step`` (1-based) out of ``total_steps``.

    Warm-up rises linearly from ``lr_warmup_init`` to ``max_lr`` over ``lr_warmup_iters`` steps
    (or ``lr_warmup_fraction`` of the total when that is 0); the decay then goes from ``max_lr``
    to ``min_lr`` by ``lr_decay_iters`` (null: the last step) and stays there.
    """
    max_lr, min_lr = float(sched["max_lr"]), float(sched["min_lr"])
    warmup = int(sched["lr_warmup_iters"]) or round(float(sched["lr_warmup_fraction"]) * total_steps)
    done = step - 1  # steps completed before this one
    if done < warmup:
        init = float(sched["lr_warmup_init"])
        return init + (max_lr - init) * (done + 1) / warmup
    style = sched["lr_decay_style"]
    if style == "constant":
        return max_lr
    decay_end = sched["lr_decay_iters"] or total_steps
    progress = min(max(done - warmup, 0) / max(decay_end - 1 - warmup, 1), 1.0)
    if style == "linear":
        return max_lr - (max_lr - min_lr) * progress
    if style == "cosine":
        return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise expected("actor.lr_sched.lr_decay_style", style, "one of ['constant', 'linear', 'cosine']")
