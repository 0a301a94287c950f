"""The per-step learning rate against hand-computed values."""

import math

import pytest

from embodied.lr_schedule import learning_rate

SCHED = dict(lr_warmup_fraction=0.0, lr_warmup_init=0.0, lr_warmup_iters=0, max_lr=1.0, min_lr=0.0,
             lr_decay_style="constant", lr_decay_iters=None)


def rates(total, **changes):
    return [learning_rate(step, dict(SCHED, **changes), total) for step in range(1, total + 1)]


def test_constant_is_max_lr_at_every_step():
    assert rates(4) == [1.0, 1.0, 1.0, 1.0]


def test_linear_decays_from_max_at_the_first_step_to_min_at_the_last():
    assert rates(5, lr_decay_style="linear", min_lr=0.2) == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


def test_cosine_passes_the_midpoint_halfway():
    lrs = rates(5, lr_decay_style="cosine")
    assert lrs == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0])


def test_warmup_rises_to_max_then_decay_starts():
    # 2 warm-up steps from 0.5: 0.75, 1.0; then linear decay over the 3 remaining steps
    assert rates(5, lr_warmup_iters=2, lr_warmup_init=0.5, lr_decay_style="linear") == pytest.approx(
        [0.75, 1.0, 1.0, 0.5, 0.0])


def test_warmup_fraction_counts_steps_of_the_run():
    assert rates(4, lr_warmup_fraction=0.5) == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_decay_stops_at_lr_decay_iters():
    assert rates(5, lr_decay_style="linear", lr_decay_iters=3) == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])
