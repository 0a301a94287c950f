"""The math reference's algorithm options, cross-checked on random inputs against an independent
transcription of veRL's published definitions (``verl/trainer/ppo/core_algos.py``: agg_loss,
compute_policy_loss with clip-higher and dual clip, compute_grpo_outcome_advantage, kl_penalty)
and of RLinf's REINFORCE++ (``rlinf/algorithms/advantages.py``: compute_reinpp_advantages, the
estimator behind the ``adv_type: reinpp`` of RLinf's configs), plus hand-computed values."""

import math
from collections import defaultdict

import pytest
import torch

from embodied.algorithms.advantages import ADVANTAGES, StepSignals, grpo_advantages
from embodied.algorithms.kl import kl_penalty
from embodied.algorithms.levels import expand_like
from embodied.algorithms.losses import actor_critic_loss, aggregate_loss, ppo_policy_loss
from embodied.algorithms.trajectory import normalize, truncated_is_weights
from embodied.batch import Samples

# ------------------------------------------------ veRL's definitions, transcribed for reference


def verl_agg_loss(loss_mat, loss_mask, mode):
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq = (loss_mat * loss_mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return seq.mean()
    if mode == "seq-mean-token-mean":
        return (seq / loss_mask.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return seq.sum() / loss_mask.shape[-1]
    raise ValueError(mode)


def verl_policy_loss(old, new, adv, mask, low, high, c, mode):
    ratio = torch.exp(torch.clamp(new - old, -20.0, 20.0))
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clipped1 = torch.maximum(losses1, losses2)
    clipped2 = torch.minimum(-adv * c, clipped1)
    losses = torch.where(adv < 0, clipped2, clipped1)
    return verl_agg_loss(losses, mask, mode)


def verl_grpo(scores, index, norm_by_std, eps=1e-6):
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[g].append(scores[i])
    out = scores.clone()
    for i, g in enumerate(index):
        members = torch.stack(groups[g])
        mean, std = members.mean(), members.std()
        out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out


def verl_kl(logprob, ref, kind):
    if kind == "kl":
        return logprob - ref
    if kind == "abs":
        return (logprob - ref).abs()
    if kind == "mse":
        return 0.5 * (logprob - ref).square()
    kl = ref - logprob
    return torch.clamp(torch.exp(kl) - kl - 1, -10, 10)


def rlinf_reinpp(rewards, loss_mask, group_size, baseline, kl_beta=0.0, kl=None):
    """Rewards ``[B]`` at each response's last valid token, KL per token ``[L, B]``; the return is
    the sum from a token to the end, whitened over all valid tokens (population variance)."""
    if baseline:
        grouped = rewards.view(-1, group_size)
        rewards = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    length = loss_mask.shape[0]
    last = length - 1 - loss_mask.long().flip(0).argmax(dim=0)
    r = torch.zeros(loss_mask.shape)
    r[last, torch.arange(rewards.shape[0])] = rewards
    if kl_beta:
        r = r - kl_beta * kl
    returns = r.flip(0).cumsum(0).flip(0)
    mean = (returns * loss_mask).sum() / loss_mask.sum()
    var = (((returns - mean) ** 2) * loss_mask).sum() / loss_mask.sum()
    return returns, (returns - mean) * var.clamp(min=1e-8).rsqrt()


def _ours_reinpp(rewards, adv_type, group_size):
    """Our estimator and the batch whitening on single-step episodes (one response each)."""
    done = torch.ones(1, rewards.shape[0], dtype=torch.bool)
    estimate = ADVANTAGES.get(adv_type)(StepSignals(rewards[None], done, torch.zeros_like(done)),
                                        {"group_size": group_size})
    batch = Samples(forward_inputs={}, actions=torch.zeros(rewards.shape[0], 1, 1), old_logprobs=torch.zeros(rewards.shape[0]),
                    advantages=estimate.advantages[0].clone(), mask=estimate.mask[0],
                    token_mask=torch.ones(rewards.shape[0], 1, 1, dtype=torch.bool))
    return estimate.advantages[0], normalize(batch, {"normalize_advantages": True, "adv_type": adv_type}, None).advantages


def _batch(seed, b=6, t=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    new = old + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    return old, new, adv, mask


# ------------------------------------------------------------------------- cross-checks
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", range(5))
def test_policy_loss_matches_verl(mode, seed):
    old, new, adv, mask = _batch(seed)
    ours, _ = ppo_policy_loss(new[:, None], old[:, None], adv[:, None], mask[:, None].bool(), clip_ratio_low=0.2,
                              clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_func=mode)
    theirs = verl_policy_loss(old, new, adv, mask, 0.2, 0.28, 3.0, mode)
    # veRL's seq-mean-token-sum-norm sums over the batch; ours averages (a constant factor)
    scale = old.shape[0] if mode == "seq-mean-token-sum-norm" else 1
    torch.testing.assert_close(ours * scale, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_grpo_advantages_match_verl(norm, seed):
    scores = torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    ours = grpo_advantages(scores, 8, normalize_std=norm)
    theirs = verl_grpo(scores, [i // 8 for i in range(32)], norm)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_estimators_match_verl(kind):
    g = torch.Generator().manual_seed(0)
    logprob, ref = -torch.rand(64, generator=g) * 4, -torch.rand(64, generator=g) * 4
    torch.testing.assert_close(kl_penalty(logprob, ref, kind), verl_kl(logprob, ref, kind))


@pytest.mark.parametrize("adv_type", ["reinpp", "reinpp_baseline"])
@pytest.mark.parametrize("seed", range(5))
def test_reinpp_advantages_match_rlinf(adv_type, seed):
    """Responses of one length (all tokens valid): every token's advantage is RLinf's. (With
    lengths that differ, RLinf's whitening weighs a response by its tokens, ours every response
    alike, as our GAE whitening weighs samples.)"""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (32,), generator=g).float() + torch.rand(32, generator=g) * 0.1
    _, ours = _ours_reinpp(rewards, adv_type, 8)
    _, theirs = rlinf_reinpp(rewards, torch.ones(5, 32), 8, adv_type == "reinpp_baseline")
    torch.testing.assert_close(ours.expand(5, 32), theirs, rtol=1e-6, atol=1e-6)


def test_reinpp_kl_in_the_reward_is_rlinfs_return_at_the_first_token():
    """With ``use_kl_in_reward`` the step's reward carries the KL of all its tokens: the return of
    a response is RLinf's at its first token (RLinf's later tokens carry only the KL after them)."""
    g = torch.Generator().manual_seed(0)
    rewards, kl = torch.rand(8, generator=g), torch.rand(6, 8, generator=g) * 0.2
    returns, _ = _ours_reinpp(rewards - 0.01 * kl.sum(dim=0), "reinpp", 1)
    theirs, _ = rlinf_reinpp(rewards, torch.ones(6, 8), 1, False, kl_beta=0.01, kl=kl)
    torch.testing.assert_close(returns, theirs[0])


@pytest.mark.parametrize("seed", range(3))
def test_truncated_is_weights_scale_each_tokens_advantage_as_rlinf_does(seed):
    """RLinf's importance_sampling_fix: advantages times clamp(exp(recomputed - rollout), max=clip),
    then veRL's clipped surrogate; ours through the actor's loss on the same tokens."""
    old, new, adv, mask = _batch(seed)
    rollout = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(seed + 100)) * 0.3
    weights = truncated_is_weights(old[None, :, None], rollout[None, :, None], "token_level", 1.2)
    assert weights.shape == (6, 1, 7) and weights.max() <= 1.2
    ours, _ = ppo_policy_loss(new[:, None], old[:, None], expand_like(adv[:, 0], weights) * weights,
                              mask[:, None].bool(), clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                              loss_agg_func="token-mean")
    theirs = verl_policy_loss(old, new, adv * torch.clamp((old - rollout).exp(), max=1.2), mask, 0.2, 0.28, 3.0,
                              "token-mean")
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_truncated_is_weights_by_hand_at_each_level():
    # one sample, one chunk of 2 actions x 2 tokens; log pi_old - log pi_rollout per token:
    diff = torch.tensor([[[[0.1, -0.3], [0.5, 0.4]]]])
    rollout = torch.zeros_like(diff)
    at = {level: truncated_is_weights(diff, rollout, level, 2.0) for level in ("token_level", "action_level", "chunk_level")}
    torch.testing.assert_close(at["token_level"], diff.exp().clamp(max=2.0).flatten(0, 1))
    torch.testing.assert_close(at["action_level"], torch.tensor([[math.exp(-0.2), 2.0]]))  # e^0.9 > 2: cut
    torch.testing.assert_close(at["chunk_level"], torch.tensor([2.0]))  # e^0.7 > 2


# ---------------------------------------------------------------------------- by hand
def test_reinpp_returns_to_go_of_each_first_episode_by_hand():
    # env 0: rewards 1, 0, 2 and no end: returns 3, 2, 2; env 1 ends at step 1 (rewards 0, 1, then
    # 5 of a next episode): returns 1, 1, masked; group of both: scores 3 and 1, mean 2
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 5.0]])
    done = torch.tensor([[False, False], [False, True], [False, False]])
    steps = StepSignals(rewards, done, torch.zeros_like(done))
    plain = ADVANTAGES.get("reinpp")(steps, {"group_size": 2})
    assert plain.advantages.tolist() == [[3.0, 1.0], [2.0, 1.0], [2.0, 0.0]]
    assert plain.mask.tolist() == [[True, True], [True, True], [True, False]]
    baseline = ADVANTAGES.get("reinpp_baseline")(steps, {"group_size": 2})
    assert baseline.advantages.tolist() == [[1.0, -1.0], [0.0, -1.0], [0.0, 0.0]]
    assert ADVANTAGES.declared("reinpp")["normalize"] and ADVANTAGES.declared("reinpp_baseline")["needs_groups"]

def test_dr_grpo_advantages_and_sum_norm_by_hand():
    # group [1, -1, -1, -1]: mean -0.5, so Dr. GRPO gives 1.5 / -0.5 (no std division)
    assert grpo_advantages(torch.tensor([1.0, -1, -1, -1]), 4, normalize_std=False).tolist() == [1.5, -0.5, -0.5, -0.5]
    loss = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[5.0, 6.0, 7.0, 8.0]]])
    mask = torch.tensor([[[1, 1, 0, 0]], [[1, 1, 1, 0]]])
    # token sums 3 and 18, over a horizon of 4 token slots, mean over 2 samples: (3 + 18) / 4 / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(21 / 8)


def test_a_huge_log_ratio_stays_finite():
    loss, metrics = ppo_policy_loss(torch.tensor([200.0]), torch.tensor([0.0]), torch.tensor([-1.0]), None,
                                    clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
                                    loss_agg_func="token-mean")
    assert torch.isfinite(loss) and loss.item() == pytest.approx(torch.exp(torch.tensor(20.0)).item())


def test_masked_tokens_do_not_count_in_any_term():
    old, new, adv, mask = _batch(0)
    entropy = torch.rand_like(new)
    ref = new - 0.3

    def loss_of(logprobs):
        loss, _ = actor_critic_loss(
            logprobs=logprobs[:, None], old_logprobs=old[:, None], advantages=adv[:, 0], mask=None,
            token_mask=mask[:, None].bool(), clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
            loss_agg_func="token-mean", entropy=entropy[:, None] * logprobs[:, None].exp(), entropy_bonus=0.01,
            values=None, old_values=None, returns=None, value_clip=None, value_loss_coef=0.5,
            ref_logprobs=ref[:, None], kl_beta=0.1, kl_penalty_type="low_var_kl", early_stop_imp_ratio=None)
        return loss

    x = new.clone().requires_grad_(True)
    loss_of(x).backward()
    assert (x.grad[mask == 0] == 0).all() and (x.grad[mask == 1] != 0).any()
    garbage = torch.where(mask.bool(), new, torch.full_like(new, 7.0))
    assert loss_of(garbage).item() == pytest.approx(loss_of(new).item())


def test_grpo_advantages_are_not_whitened_again_over_the_batch():
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, -0.5, -0.5])
    batch = Samples(forward_inputs={}, actions=torch.zeros(8, 1, 1), old_logprobs=torch.zeros(8),
                    advantages=adv.clone(), mask=torch.ones(8, dtype=torch.bool),
                    token_mask=torch.ones(8, 1, 1, dtype=torch.bool))
    normalize(batch, {"normalize_advantages": True, "adv_type": "grpo"}, all_reduce=None)
    assert torch.equal(batch.advantages, adv)


# ------------------------------------------------------- algorithm.use_valid_token_scale
def _token_mean_loss(theta, old, advantages, mask, token_mask) -> torch.Tensor:
    return actor_critic_loss(
        logprobs=theta, old_logprobs=old, advantages=advantages, mask=mask, token_mask=token_mask,
        clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_func="token-mean", entropy=None,
        entropy_bonus=0.0, values=None, old_values=None, returns=None, value_clip=None, value_loss_coef=0.0,
        ref_logprobs=None, kl_beta=0.0, kl_penalty_type="kl", early_stop_imp_ratio=None)[0]


def _valid_token_scale_rank(rank: int, results) -> None:
    """Each of 2 ranks: its 6 samples in micro-batches of 2 (1 to 8 valid tokens each), the
    gradient of the micro-batch losses averaged over micro-batches and ranks, weighed as the actor
    weighs them (ActorWorker._weights) and not."""
    import torch.distributed as dist

    from embodied.algorithms import valid_mask, valid_token_weights

    def batch(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(r)
        lengths = torch.randint(1, 9, (6,), generator=g)
        token_mask = (torch.arange(8)[None] < lengths[:, None])[:, None]  # [N, C=1, A=8]
        return [torch.randn(6, 1, 8, generator=g), torch.randn(6, 1, 8, generator=g),
                torch.randn(6, 1, generator=g), torch.ones(6, 1, dtype=torch.bool), token_mask]

    new, old, advantages, mask, token_mask = batch(rank)
    parts = list(torch.arange(6).split(2))
    tokens = torch.stack([valid_mask(mask[p], token_mask[p], old[p]).sum() for p in parts]).double()
    total = tokens.sum()
    dist.all_reduce(total)
    for name, weights in (("weighed", valid_token_weights(tokens, total, 2).tolist()), ("plain", [1.0] * 3)):
        theta = new.clone().requires_grad_()
        for weight, p in zip(weights, parts):
            loss = _token_mean_loss(theta[p], old[p], advantages[p], mask[p], token_mask[p])
            (loss * weight / len(parts)).backward()
        grads = [torch.zeros(6, 1, 8), torch.zeros(6, 1, 8)]
        dist.all_gather(grads, theta.grad / 2)  # the mean over ranks, each rank's samples apart
        results[(rank, name)] = torch.cat(grads)
    # the reference: one token mean over both ranks' 12 samples
    both = [torch.cat(t) for t in zip(batch(0), batch(1))]
    theta = both[0].clone().requires_grad_()
    _token_mean_loss(theta, *both[1:]).backward()
    results[(rank, "token_mean")] = theta.grad


def test_valid_token_scale_makes_the_step_one_token_mean_over_all_ranks():
    from tests.runs import on_two_gloo_ranks

    results = on_two_gloo_ranks(_valid_token_scale_rank)
    for rank in (0, 1):
        reference = results[(rank, "token_mean")]
        assert torch.allclose(results[(rank, "weighed")], reference, atol=1e-7)
        assert not torch.allclose(results[(rank, "plain")], reference, atol=1e-4)  # a mean of micro-batch means
