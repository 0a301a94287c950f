"""PPO losses and aggregation against values derived by hand in the comments."""

import math

import pytest
import torch

from embodied.algorithms.losses import (
    actor_critic_loss,
    aggregate_loss,
    loss_hyperparameters,
    ppo_policy_loss,
    value_loss,
)


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- aggregation
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third sample fully masked


@pytest.mark.parametrize(
    "func, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5
        ("seq-mean-token-mean", (2 + 4) / 2),  # 3
    ],
)
def test_aggregate_loss(func, expected):
    _close(aggregate_loss(LOSS, MASK, func), expected)


def test_aggregate_without_mask_and_all_masked():
    _close(aggregate_loss(LOSS, None, "seq-mean-token-sum"), (6 + 4 + 24) / 3)
    x = torch.ones(2, 2, requires_grad=True)
    out = aggregate_loss(x, torch.zeros(2, 2), "seq-mean-token-mean")
    out.backward()
    assert out.item() == 0.0 and x.grad.abs().sum().item() == 0.0


def test_aggregate_rejects_unknown_name():
    with pytest.raises(ValueError, match="algorithm.loss_agg_func"):
        aggregate_loss(LOSS, None, "mean")


# ---------------------------------------------------------------- policy loss
RATIO = torch.tensor([1.5, 0.5, 1.1, 0.5])
ADV = torch.tensor([1.0, 1.0, -2.0, -1.0])


def _policy(ratio, adv, **kw):
    logp = torch.log(ratio).requires_grad_()
    args = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None, loss_agg_func="token-mean")
    args.update(kw)
    loss, metrics = ppo_policy_loss(logp, torch.zeros_like(logp), adv, None, **args)
    loss.backward()
    return loss, metrics, logp.grad


def test_ppo_clipped_loss_by_hand():
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5 A=+1: max(-1.5, -1.2) = -1.2   clipped
    #   r=0.5 A=+1: max(-0.5, -0.8) = -0.5
    #   r=1.1 A=-2: max( 2.2,  2.2) =  2.2
    #   r=0.5 A=-1: max( 0.5,  0.8) =  0.8   clipped
    # mean = 1.3 / 4 = 0.325; clip fraction 2/4
    loss, metrics, grad = _policy(RATIO, ADV)
    _close(loss, 0.325)
    _close(metrics["actor/clip_fraction"], 0.5)
    # d/dlogp of -A r is -A r where unclipped, 0 where clipped; / 4 tokens
    _close(grad, [0.0, -0.5 / 4, 2.2 / 4, 0.0])
    # approx KL = mean((r - 1) - log r)
    expected_kl = sum((r - 1) - math.log(r) for r in [1.5, 0.5, 1.1, 0.5]) / 4  # 0.1213797
    _close(metrics["actor/approx_kl"], expected_kl)
    _close(metrics["actor/ratio"], (1.5 + 0.5 + 1.1 + 0.5) / 4)


def test_ppo_separate_low_and_high_clip():
    # low 0.1, high 0.3 -> clip to [0.9, 1.3]
    #   r=1.5 A=+1: max(-1.5, -1.3) = -1.3;  r=0.5 A=+1: max(-0.5, -0.9) = -0.5
    #   r=1.1 A=-2: 2.2;                     r=0.5 A=-1: max(0.5, 0.9) = 0.9
    loss, _, _ = _policy(RATIO, ADV, clip_ratio_low=0.1, clip_ratio_high=0.3)
    _close(loss, (-1.3 - 0.5 + 2.2 + 0.9) / 4)


def test_dual_clip_bounds_negative_advantages_only():
    # r=5, A=-1: max(5, 1.2) = 5 -> dual clip min(5, 3 * 1) = 3, gradient 0
    # r=5, A=+1: max(-5, -1.2) = -1.2 (dual clip does not apply)
    ratio, adv = torch.tensor([5.0, 5.0]), torch.tensor([-1.0, 1.0])
    loss, metrics, grad = _policy(ratio, adv, clip_ratio_c=3.0)
    _close(loss, (3.0 - 1.2) / 2)
    _close(metrics["actor/dual_clip_fraction"], 0.5)
    _close(grad, [0.0, 0.0])
    loss_plain, _, grad_plain = _policy(ratio, adv)
    _close(loss_plain, (5.0 - 1.2) / 2)
    _close(grad_plain, [5.0 / 2, 0.0])  # -A r = 5 for the unbounded token


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="algorithm.clip_ratio_c"):
        _policy(RATIO, ADV, clip_ratio_c=0.5)


def test_policy_loss_mask():
    logp = torch.log(RATIO)
    mask = torch.tensor([True, True, False, False])  # only the first two: (-1.2 - 0.5) / 2
    loss, metrics = ppo_policy_loss(
        logp, torch.zeros(4), ADV, mask,
        clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None, loss_agg_func="token-mean",
    )
    _close(loss, -0.85)
    _close(metrics["actor/clip_fraction"], 0.5)


# ---------------------------------------------------------------- value loss
def test_value_loss_by_hand():
    # v = [1, 2, 2], v_old = [0.5, 1, 1], R = [2, 3, 1], value_clip 0.2
    #   clipped v = [0.7, 1.2, 1.2]
    #   unclipped errors^2 = [1, 1, 1]; clipped errors^2 = [1.69, 3.24, 0.04]
    #   max = [1.69, 3.24, 1] -> 0.5 * mean = 0.5 * 5.93 / 3
    values = torch.tensor([1.0, 2.0, 2.0])
    old, returns = torch.tensor([0.5, 1.0, 1.0]), torch.tensor([2.0, 3.0, 1.0])
    loss, metrics = value_loss(values, old, returns, None, value_clip=0.2)
    _close(loss, 0.5 * 5.93 / 3)
    _close(metrics["critic/value_clip_fraction"], 1.0)
    loss, _ = value_loss(values, old, returns, None, value_clip=None)
    _close(loss, 0.5)  # 0.5 * mean([1, 1, 1])
    # explained variance: Var(R) = 2/3, R - V = [1, 1, -1] has Var 8/9 -> 1 - (8/9)/(2/3) = -1/3
    _close(metrics["critic/explained_variance"], -1.0 / 3.0)


def test_huber_value_loss_against_its_definition_on_random_inputs():
    """``huber_delta``: elementwise 0.5 e^2 inside |e| <= delta, delta (|e| - delta / 2) outside
    (written here from the definition in numpy), with the value clip's pessimistic max on top;
    null keeps the squared error exactly."""
    import numpy as np

    rng = np.random.default_rng(0)
    for delta, clip in ((0.5, None), (1.0, 0.2), (2.0, 0.5)):
        v, old, r = (rng.normal(0, 2, 64) for _ in range(3))
        mask = rng.random(64) > 0.3

        def huber(e):
            return np.where(np.abs(e) <= delta, 0.5 * e ** 2, delta * (np.abs(e) - 0.5 * delta))

        errors = huber(v - r)
        if clip is not None:
            errors = np.maximum(errors, huber(old + np.clip(v - old, -clip, clip) - r))
        loss, _ = value_loss(*(torch.tensor(x) for x in (v, old, r, mask)), value_clip=clip, huber_delta=delta)
        assert loss.item() == pytest.approx(errors[mask].mean(), rel=1e-9)
        squared, _ = value_loss(*(torch.tensor(x) for x in (v, old, r, mask)), value_clip=clip)
        unclipped = 0.5 * (v - r) ** 2
        if clip is not None:
            unclipped = np.maximum(unclipped, 0.5 * (old + np.clip(v - old, -clip, clip) - r) ** 2)
        assert squared.item() == pytest.approx(unclipped[mask].mean(), rel=1e-9)


# ---------------------------------------------------------------- composition
def _full(**overrides):
    args = dict(
        logprobs=torch.log(torch.tensor([[1.5, 0.5], [1.1, 0.5]])),  # [N=2, C=2] action-level
        old_logprobs=torch.zeros(2, 2),
        advantages=torch.tensor([1.0, -1.0]),  # one per chunk
        mask=torch.tensor([True, True]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=None,
        loss_agg_func="token-mean",
        entropy=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        entropy_bonus=0.1,
        values=torch.tensor([1.0, 0.0]),
        old_values=torch.tensor([1.0, 0.0]),
        returns=torch.tensor([2.0, 0.0]),
        value_clip=None,
        value_loss_coef=0.5,
        ref_logprobs=torch.zeros(2, 2),
        kl_beta=0.01,
        kl_penalty_type="kl",
        early_stop_imp_ratio=None,
    )
    args.update(overrides)
    return actor_critic_loss(**args)


def test_actor_critic_loss_composes_the_terms():
    # policy: chunk advantages broadcast over actions:
    #   r=1.5 A=+1 -> -1.2; r=0.5 A=+1 -> -0.5; r=1.1 A=-1 -> 1.1; r=0.5 A=-1 -> 0.8; mean 0.2/4 = 0.05
    # value: 0.5 * mean([1, 0]) = 0.25, times coef 0.5 -> 0.125
    # entropy: mean 2.5, times 0.1 -> -0.25
    # kl (k1 vs zeros): mean(log r) = log(1.5 * 0.5 * 1.1 * 0.5) / 4, times 0.01
    kl = math.log(1.5 * 0.5 * 1.1 * 0.5) / 4
    loss, metrics = _full()
    _close(loss, 0.05 + 0.125 - 0.25 + 0.01 * kl)
    _close(metrics["actor/kl"], kl)
    _close(metrics["actor/entropy"], 2.5)
    _close(metrics["actor/early_stopped"], 0.0)


def test_actor_critic_loss_masks_samples_and_skips_absent_terms():
    # only sample 0: policy (-1.2 - 0.5) / 2 = -0.85; no values, entropy or KL
    loss, metrics = _full(
        mask=torch.tensor([True, False]), entropy=None, values=None, ref_logprobs=None
    )
    _close(loss, -0.85)
    assert "critic/value_loss" not in metrics and "actor/kl" not in metrics


def test_early_stop_abandons_micro_batch_when_mean_ratio_too_high():
    logprobs = torch.log(torch.tensor([[8.0, 8.0], [1.0, 1.0]])).requires_grad_()
    loss, metrics = _full(logprobs=logprobs, early_stop_imp_ratio=4.0)  # mean ratio 4.5 > 4
    loss.backward()
    assert loss.item() == 0.0 and logprobs.grad.abs().sum().item() == 0.0
    _close(metrics["actor/early_stopped"], 1.0)
    loss, metrics = _full(logprobs=torch.log(torch.tensor([[8.0, 8.0], [1.0, 1.0]])), early_stop_imp_ratio=5.0)
    assert loss.item() != 0.0 and metrics["actor/early_stopped"].item() == 0.0


def test_loss_hyperparameters_from_config():
    cfg = dict(
        loss_type="ppo", ratio_clip_eps=0.2, clip_ratio_low=None, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_func="token-mean",
        entropy_bonus=0.0, value_clip=None, huber_delta=None, value_loss_coef=0.5, kl_beta=0.0, kl_penalty_type="low_var_kl",
        early_stop_imp_ratio=5.0,
    )
    hp = loss_hyperparameters(cfg)
    assert hp["clip_ratio_low"] == 0.2 and hp["clip_ratio_high"] == 0.28  # unset low follows ratio_clip_eps
    loss, _ = _full(**hp)  # the keys are exactly actor_critic_loss's hyperparameters
    assert torch.isfinite(loss)
    del cfg["value_loss_coef"]
    with pytest.raises(KeyError, match="algorithm.value_loss_coef"):
        loss_hyperparameters(cfg)


# ---------------------------------------------------------------- decoupled PPO
def _decoupled(logprobs, old, proximal, adv, mask=None, threshold=None, c=None, agg="token-mean"):
    from embodied.algorithms.losses import decoupled_policy_loss

    return decoupled_policy_loss(logprobs, old, adv, mask, proximal_logprobs=proximal,
                                 behave_weight_threshold=threshold, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                 clip_ratio_c=c, loss_agg_func=agg)


def test_decoupled_loss_by_hand():
    # token 0: r = pi / pi_prox = e^0.1 = 1.105 (inside the clip), w = pi_prox / pi_behave = e^0.2,
    #   A = 1: loss = -1.105 * 1.2214 = -1.3499
    # token 1: r = e^0.5 = 1.6487 clipped to 1.2 for A = 2: loss = -2.4 * w, w = e^-0.3 = 0.7408 -> -1.7779
    # token 2: w = e^1.0 = 2.718 > threshold 2: weighs 0
    logprobs = torch.tensor([0.1, 0.5, 0.0])
    proximal = torch.tensor([0.0, 0.0, 0.0])
    old = torch.tensor([-0.2, 0.3, -1.0])
    adv = torch.tensor([1.0, 2.0, 1.0])
    loss, metrics = _decoupled(logprobs, old, proximal, adv, threshold=2.0)
    expected = (-math.exp(0.1) * math.exp(0.2) - 2.4 * math.exp(-0.3) + 0.0) / 3
    _close(loss, expected)
    _close(metrics["actor/behave_filtered_fraction"], 1 / 3)
    _close(metrics["actor/clip_fraction"], 1 / 3)


def test_decoupled_loss_with_fresh_samples_is_ppo_exactly():
    """Staleness 0: the proximal policy is the behaviour policy, w = 1, and the loss, its
    gradient and its metrics are PPO's, bit for bit."""
    torch.manual_seed(0)
    for agg, c in (("token-mean", None), ("seq-mean-token-sum", 3.0), ("seq-mean-token-sum-norm", 2.0)):
        old = torch.randn(6, 4)
        new = (old + 0.3 * torch.randn(6, 4)).requires_grad_(True)
        adv, mask = torch.randn(6, 4), torch.rand(6, 4) > 0.2
        ppo, ppo_metrics = ppo_policy_loss(new, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                           clip_ratio_c=c, loss_agg_func=agg)
        (ppo_grad,) = torch.autograd.grad(ppo, new)
        ours, our_metrics = _decoupled(new, old, old.clone(), adv, mask, threshold=2.0, c=c, agg=agg)
        (our_grad,) = torch.autograd.grad(ours, new)
        assert torch.equal(ours, ppo) and torch.equal(our_grad, ppo_grad)
        for key, value in ppo_metrics.items():
            assert torch.equal(our_metrics[key], value), key


def test_decoupled_loss_matches_the_published_objective_on_random_inputs():
    """Against the objective of Hilton et al. (2022), eq. for decoupled PPO, written out here
    independently: E[ (pi_prox / pi_behav) * min(r A, clip(r, 1 - eps, 1 + eps) A) ], r = pi / pi_prox,
    negated; samples whose behaviour weight exceeds the threshold dropped from the sum (not the count)."""
    torch.manual_seed(1)
    for _ in range(20):
        behav = torch.randn(32) - 1.0
        prox = behav + 0.5 * torch.randn(32)
        cur = prox + 0.3 * torch.randn(32)
        adv = torch.randn(32)
        r = torch.exp(cur - prox)
        w = torch.exp(prox - behav)
        objective = w * torch.minimum(r * adv, torch.clamp(r, 0.8, 1.2) * adv)
        objective = torch.where(w <= 1.5, objective, torch.zeros_like(objective))
        ours, _ = _decoupled(cur, behav, prox, adv, threshold=1.5)
        torch.testing.assert_close(ours, -objective.mean(), rtol=1e-5, atol=1e-6)
