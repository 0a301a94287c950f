"""KL estimators: hand values, and that k1/k3 estimate a known Gaussian KL."""

import math

import pytest
import torch

from embodied.algorithms.kl import kl_penalty

# log_ratio = logprob - ref = [0.5, -1.0]
LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("kl", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),  # 0.5 * d^2
        # exp(-d) + d - 1: exp(-0.5) - 0.5 = 0.1065307, e - 2 = 0.7182818
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_kl_penalty_by_hand(kind, expected):
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor(expected), rtol=0, atol=1e-6)


def test_low_var_kl_is_bounded():
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0


def test_unknown_type_names_the_key():
    with pytest.raises(ValueError, match="algorithm.kl_penalty_type"):
        kl_penalty(LOGP, REF, "reverse")


def test_k1_and_k3_estimate_gaussian_kl():
    # KL(N(0,1) || N(0.5,1)) = 0.5^2 / 2 = 0.125, estimated from samples of the first.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen)
    p, q = torch.distributions.Normal(0.0, 1.0), torch.distributions.Normal(0.5, 1.0)
    logp, logq = p.log_prob(x), q.log_prob(x)
    for kind in ("kl", "low_var_kl"):
        assert abs(kl_penalty(logp, logq, kind).mean().item() - 0.125) < 0.01, kind


def test_gradient_flows_through_logprobs_only():
    logp = LOGP.clone().requires_grad_()
    ref = REF.clone().requires_grad_()
    kl_penalty(logp, ref.detach(), "mse").sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, -1.0]))  # d/dlogp 0.5 d^2 = d
