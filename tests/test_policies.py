"""Small policies: the act/evaluate contract, log-prob levels, config errors, and a real
learning signal (PPO on a contextual bandit with the project's own loss functions)."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from embodied.algorithms import actor_critic_loss, compute_gae, normalize_advantages
from embodied.algorithms import reduce_logprobs
from embodied.config import build_policy
from policies import POLICIES

STATE_DIM, IMAGE = 4, 16


def make_cfg(**overrides):
    cfg = dict(
        model_type="mlp", state_dim=STATE_DIM, action_dim=2, num_action_chunks=2, hidden_dims=[64, 64],
        action_distribution="gaussian", n_action_bins=21, init_log_std=-0.5, add_value_head=True,
        value_type="chunk_level", image_size=[IMAGE, IMAGE], conv_channels=[8, 16], conv_kernels=[4, 3],
        conv_strides=[2, 1], image_feature_dim=32, state_feature_dim=16,
    )
    cfg.update(overrides)
    return cfg


def make_obs(n, seed=0):
    """States in [-1, 1]^4 and flat-colour images whose brightness is the CNN task's signal."""
    gen = torch.Generator().manual_seed(seed)
    brightness = torch.randint(0, 256, (n,), generator=gen)
    return {
        "states": torch.rand(n, STATE_DIM, generator=gen) * 2 - 1,
        "main_images": brightness.view(n, 1, 1, 1).expand(n, IMAGE, IMAGE, 3).to(torch.uint8).contiguous(),
        "task_descriptions": ["push the cube"] * n,
    }


KINDS = [("mlp", "gaussian"), ("mlp", "bins"), ("cnn", "gaussian"), ("cnn", "bins")]


@pytest.mark.parametrize("model_type", ["mlp", "cnn"])
def test_shipped_yaml_builds(model_type):
    model = OmegaConf.load(f"config/model/{model_type}.yaml")
    root = OmegaConf.create({"algorithm": {"reward_type": "action_level"}, "actor": {"model": model}})
    policy = build_policy(root.actor.model)
    assert isinstance(policy, POLICIES.get(model_type))
    n, (h, w) = 3, model.get("image_size", [1, 1])
    obs = {
        "states": np.zeros((n, model.state_dim), np.float32),
        "main_images": np.zeros((n, h, w, 3), np.uint8),
    }
    out = policy.act(obs)
    assert out.actions.shape == (n, model.num_action_chunks, model.action_dim)
    assert out.values.shape == (n, model.num_action_chunks)  # action_level: a value per action


@pytest.mark.parametrize("model_type, dist", KINDS)
@pytest.mark.parametrize("value_type", ["chunk_level", "action_level"])
def test_act_shapes_and_evaluate_reproduces_logprobs(model_type, dist, value_type):
    torch.manual_seed(0)
    policy = build_policy(make_cfg(model_type=model_type, action_distribution=dist, value_type=value_type))
    out = policy.act(make_obs(8))
    assert out.actions.shape == out.logprobs.shape == (8, 2, 2)
    assert out.actions.dtype == torch.float32
    assert out.values.shape == ((8,) if value_type == "chunk_level" else (8, 2))
    assert not out.logprobs.requires_grad

    evaluated = policy.evaluate(out.forward_inputs, out.actions)
    assert torch.equal(evaluated.logprobs, out.logprobs)
    assert torch.equal(evaluated.values, out.values)
    assert evaluated.entropy.shape == (8, 2, 2) and evaluated.logprobs.requires_grad
    # a minibatch of the stored inputs gives the same numbers (up to float rounding of the batch size)
    idx = torch.tensor([5, 1, 6])
    part = policy({k: v[idx] for k, v in out.forward_inputs.items()}, out.actions[idx])
    torch.testing.assert_close(part.logprobs, out.logprobs[idx])


def test_gaussian_logprob_and_entropy_by_hand():
    # greedy action = mean: log N(mu; mu, s) = -log s - log(2 pi)/2 = 0.5 - 0.9189385 per token,
    # entropy = 1/2 + log(2 pi)/2 + log s = 0.9189385 with log s = -0.5
    policy = build_policy(make_cfg())
    out = policy.act(make_obs(4), do_sample=False)
    torch.testing.assert_close(out.logprobs, torch.full((4, 2, 2), 0.5 - 0.5 * math.log(2 * math.pi)))
    entropy = policy.evaluate(out.forward_inputs, out.actions).entropy
    torch.testing.assert_close(entropy, torch.full((4, 2, 2), 0.5 + 0.5 * math.log(2 * math.pi) - 0.5))


@pytest.mark.parametrize("model_type, dist", KINDS)
def test_greedy_is_deterministic_and_sampling_is_not(model_type, dist):
    policy = build_policy(make_cfg(model_type=model_type, action_distribution=dist))
    obs = make_obs(16)
    assert torch.equal(policy.act(obs, do_sample=False).actions, policy.act(obs, do_sample=False).actions)
    assert not torch.equal(policy.act(obs).actions, policy.act(obs).actions)


def test_bins_emit_bin_values_and_start_near_uniform():
    policy = build_policy(make_cfg(action_distribution="bins", n_action_bins=5))
    out = policy.act(make_obs(64))
    assert set(out.actions.unique().tolist()) <= {-1.0, -0.5, 0.0, 0.5, 1.0}
    assert torch.equal(policy.action_head.tokens(out.actions), ((out.actions + 1) * 2).round().long())
    entropy = policy.evaluate(out.forward_inputs, out.actions).entropy
    assert (entropy - math.log(5)).abs().max() < 0.01  # tiny output init: all bins equally likely


def test_reduce_logprobs_levels_by_hand():
    logprobs = torch.arange(12.0).reshape(1, 3, 4)  # one sample, 3 actions of 4 dims
    assert torch.equal(reduce_logprobs(logprobs, "token_level"), logprobs)
    assert reduce_logprobs(logprobs, "action_level").tolist() == [[6.0, 22.0, 38.0]]
    assert reduce_logprobs(logprobs, "chunk_level").tolist() == [66.0]
    with pytest.raises(ValueError, match="algorithm.logprob_type"):
        reduce_logprobs(logprobs, "sequence_level")


def test_forward_inputs_own_their_memory():
    policy = build_policy(make_cfg())
    obs = {"states": np.ones((2, STATE_DIM), np.float32)}
    out = policy.act(obs)
    obs["states"][:] = 7.0  # a channel reusing its buffer
    assert out.forward_inputs["states"].eq(1.0).all()


def test_value_parameters_are_the_critic():
    for model_type in ("mlp", "cnn"):
        policy = build_policy(make_cfg(model_type=model_type))
        value = policy.value_parameters()
        rest = [p for p in policy.parameters() if all(p is not v for v in value)]
        assert sum(p.numel() for p in value) == sum(p.numel() for p in policy.value_head.parameters())
        assert len(rest) + len(value) == len(list(policy.parameters()))
    no_critic = build_policy(make_cfg(add_value_head=False))
    assert no_critic.act(make_obs(2)).values is None
    assert no_critic.value_parameters() == []


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"model_type": "transformer"}, KeyError, "expected one of \\['causal_lm', 'cnn', 'mlp', 'openvla_oft'\\]"),
        ({"action_distribution": "beta"}, ValueError, "actor.model.action_distribution"),
        ({"action_distribution": "bins", "n_action_bins": 1}, ValueError, "actor.model.n_action_bins"),
        ({"value_type": "token_level"}, ValueError, "actor.model.value_type"),
        ({"state_dim": None}, KeyError, "actor.model.state_dim"),
        ({"model_type": "cnn", "image_size": [4, 4]}, ValueError, "actor.model.image_size"),
        ({"model_type": "cnn", "conv_kernels": [4]}, ValueError, "conv_kernels"),
    ],
)
def test_config_errors_name_the_key(overrides, error, match):
    with pytest.raises(error, match=match):
        build_policy(make_cfg(**overrides))


def test_obs_errors_name_the_key():
    policy = build_policy(make_cfg())
    with pytest.raises(KeyError, match="obs\\['states'\\]"):
        policy.act({"main_images": np.zeros((2, IMAGE, IMAGE, 3), np.uint8)})
    with pytest.raises(ValueError, match="expected \\[B, 4\\]"):
        policy.act({"states": np.zeros((2, 5), np.float32)})


# ------------------------------------------------------------------ a real learning signal
W = torch.randn(STATE_DIM, 4, generator=torch.Generator().manual_seed(1))


def bandit_reward(actions, obs, model_type):
    """-(a - target)^2 summed over the chunk; the MLP must read states, the CNN images."""
    if model_type == "mlp":
        target = torch.tanh(obs["states"] @ W).view(-1, 2, 2)
    else:
        target = (obs["main_images"][:, 0, 0, 0].float() / 255 * 2 - 1).view(-1, 1, 1).expand(-1, 2, 2)
    return -(actions.clamp(-1, 1) - target).square().sum(dim=(1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("model_type, dist", KINDS)
def test_ppo_improves_contextual_bandit_return(model_type, dist):
    torch.manual_seed(0)
    level = "chunk_level" if dist == "gaussian" else "token_level"
    policy = build_policy(make_cfg(model_type=model_type, action_distribution=dist))
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3, eps=1e-5)
    eval_obs = make_obs(512, seed=123)

    def greedy_return():
        return bandit_reward(policy.act(eval_obs, do_sample=False).actions, eval_obs, model_type).mean().item()

    before = greedy_return()
    for iteration in range(25):
        obs = make_obs(256, seed=iteration)
        out = policy.act(obs)
        rewards = bandit_reward(out.actions, obs, model_type)[None]  # one-step episodes: T = 1
        values = torch.stack([out.values, torch.zeros_like(out.values)])
        ended = torch.ones(1, 256, dtype=torch.bool)
        advantages, returns = compute_gae(rewards, values, ended, ~ended, gamma=0.99, gae_lambda=0.95)
        for _ in range(4):
            for idx in torch.randperm(256).split(64):
                new = policy({k: v[idx] for k, v in out.forward_inputs.items()}, out.actions[idx])
                loss, _ = actor_critic_loss(
                    logprobs=reduce_logprobs(new.logprobs, level),
                    old_logprobs=reduce_logprobs(out.logprobs[idx], level),
                    advantages=normalize_advantages(advantages[0, idx]), mask=None,
                    clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_func="token-mean",
                    entropy=reduce_logprobs(new.entropy, level), entropy_bonus=0.0,
                    values=new.values, old_values=out.values[idx], returns=returns[0, idx],
                    value_clip=None, value_loss_coef=0.5,
                    ref_logprobs=None, kl_beta=0.0, kl_penalty_type="kl", early_stop_imp_ratio=None,
                )
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
                optimizer.step()
    after = greedy_return()
    # the squared error of the greedy action shrinks at least 4x (measured here: 16x-36x)
    assert after > 0.25 * before, (before, after)


# ------------------------------------------------------------------ under FSDP2 (2 gloo ranks)
def _fsdp_rank(rank, results):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    cfg = make_cfg(model_type="cnn")
    rollout_copy, trained = build_policy(cfg), build_policy(cfg)
    trained.load_state_dict(rollout_copy.state_dict())
    out = rollout_copy.act(make_obs(6, seed=rank))
    fully_shard(trained)
    new = trained(out.forward_inputs, out.actions)  # forward == evaluate, so FSDP's hooks run
    reduce_logprobs(new.logprobs, "chunk_level").mean().backward()
    results[rank] = (torch.equal(new.logprobs, out.logprobs), torch.equal(new.values, out.values))


@pytest.mark.slow
def test_evaluate_under_fsdp2_reproduces_act():
    from tests.runs import on_two_gloo_ranks

    assert on_two_gloo_ranks(_fsdp_rank) == {0: (True, True), 1: (True, True)}
