"""Estimators when the engine's kept support S is smaller than the vocabulary and larger than the
recorded head H (K < |S| < V): top-k, top-p, a structured-output mask. mu comes from the engine's
own processing (`processed_logprobs`); every reference is a brute-force enumeration over S with
autograd on pi_S = pi renormalized over S (V = 12, float64)."""

import math

import pytest
import torch

from prodrl_pipeline.engine.processing import processed_logprobs
from prodrl_pipeline.rl.estimators import EstimatorConfig, _ratio, bernoulli_kl, objective
from tests.rl.conftest import token_inputs

V, K = 12, 2
CENTERING = EstimatorConfig(type="score_centering")
TRUNCATED = EstimatorConfig(type="score_centering", truncated_is=True, is_cap=1.5)
MASK = [0, 2, 3, 5, 8, 11]  # a structured-output constraint keeping 6 of 12 tokens


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5


def _engine_mu(logits: torch.Tensor, restriction: str) -> torch.Tensor:
    """log mu [V] = log pi_S: the kept support S chosen by the engine's own processing (which
    computes in float32), the probabilities renormalized over S in float64."""
    top_k, top_p, allowed = torch.tensor([0]), torch.tensor([1.0]), None
    if restriction == "top_k":
        top_k = torch.tensor([6])
    elif restriction == "top_p":
        top_p = torch.tensor([0.8])
    elif restriction == "mask":
        allowed = torch.zeros((1, V), dtype=torch.bool)
        allowed[0, MASK] = True
    kept = torch.isfinite(processed_logprobs(logits[None], torch.tensor([1.0]), top_k, top_p, allowed)[0])
    return logits.masked_fill(~kept, -math.inf).log_softmax(0)


def _support(log_mu: torch.Tensor) -> list[int] | None:
    kept = torch.isfinite(log_mu).nonzero().squeeze(1).tolist()
    return None if len(kept) == V else kept


def _head(log_mu: torch.Tensor, k: int = K) -> list[int]:
    return log_mu.argsort(descending=True)[:k].tolist()


def _grad_of(fn, theta):
    theta = theta.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(theta), theta)
    return g


def _estimator_grad(theta, a, log_mu, cfg, head, adv=1.0, pad=0):
    """d J(a) / d theta for one sampled token a, through the trainer's log-prob code."""

    def j(t):
        x = token_inputs(t, [a], log_mu, support=_support(log_mu), head=head, adv=adv, pad=pad)
        return objective(x, cfg)[0].sum()

    return _grad_of(j, theta)


def _score(theta, v, support):
    """grad log pi_S(v), brute force."""

    def lp(t):
        logits = (
            t
            if support is None
            else t.masked_fill(~torch.isin(torch.arange(V), torch.tensor(support)), -math.inf)
        )
        return logits.log_softmax(0)[v]

    return _grad_of(lp, theta)


def _expected(theta, log_mu, cfg, head, adv=lambda a: 1.0, pad=0):
    """E_{a ~ mu}[A(a) grad J(a)] by enumeration over the support."""
    kept = torch.isfinite(log_mu).nonzero().squeeze(1).tolist()
    return sum(log_mu[a].exp() * _estimator_grad(theta, a, log_mu, cfg, head, adv(a), pad) for a in kept)


RESTRICTIONS = ["top_k", "top_p", "mask", "none"]


@pytest.mark.parametrize("restriction", RESTRICTIONS)
@pytest.mark.parametrize("cfg", [CENTERING, TRUNCATED], ids=["centering", "truncated_is"])
def test_on_policy_expected_centered_gradient_is_zero(restriction, cfg):
    """mu = pi_S (the engine sampled from the trainer's own logits): with a constant advantage the
    expected gradient is exactly 0. A tail modelled over all of V minus H is biased here."""
    theta = _logits(0)
    log_mu = _engine_mu(theta, restriction)
    support = _support(log_mu)
    size = V if support is None else len(support)
    assert size > K and (restriction == "none") == (size == V)  # the case production hits
    g = _expected(theta, log_mu, cfg, _head(log_mu), pad=1)
    assert g.abs().max() < 1e-12, g


@pytest.mark.parametrize("restriction", RESTRICTIONS)
def test_on_policy_truncated_is_weight_is_one(restriction):
    theta = _logits(1)
    log_mu = _engine_mu(theta, restriction)
    kept = torch.isfinite(log_mu).nonzero().squeeze(1)
    x = token_inputs(theta, kept, log_mu, support=_support(log_mu), head=_head(log_mu))
    w = _ratio(x.logprobs, x.deployment_logprobs)
    torch.testing.assert_close(w, torch.ones_like(w), rtol=0, atol=1e-12)
    _, diag = objective(x, EstimatorConfig(type="score_centering", truncated_is=True, is_cap=1.0 + 1e-9))
    assert not diag["rho_truncated"].any()


@pytest.mark.parametrize("restriction", ["top_k", "top_p", "mask"])
@pytest.mark.parametrize("cfg", [CENTERING, TRUNCATED], ids=["centering", "truncated_is"])
def test_off_policy_estimate_equals_the_exact_centered_gradient(restriction, cfg):
    """mu != pi_S, per-token advantages, mu's tail over S minus H exactly alpha pi_S (the model):
    E_mu[grad J] equals sum_a mu_a A_a (w_a s_a - E_mu[w s]) enumerated with s = grad log pi_S."""
    theta, other = _logits(2), _logits(3)
    support = _support(_engine_mu(other, restriction))
    pi_s = theta.masked_fill(~torch.isin(torch.arange(V), torch.tensor(support)), -math.inf).softmax(0)
    head = [support[0], support[3]]
    tail = [v for v in support if v not in head]
    mu = torch.zeros(V)
    mu[head] = torch.tensor([0.5, 0.2])
    mu[tail] = 0.3 * pi_s[tail] / pi_s[tail].sum()
    log_mu = mu.log()
    adv = {a: 1.0 + 0.37 * a - 0.05 * a * a for a in support}
    cap = cfg.is_cap if cfg.truncated_is else math.inf
    w = {a: min(float(pi_s[a] / mu[a]), cap) if cfg.truncated_is else 1.0 for a in support}
    mean_ws = sum(min(float(pi_s[v]), cap * float(mu[v])) * _score(theta, v, support) for v in support)
    if not cfg.truncated_is:
        mean_ws = sum(mu[v] * _score(theta, v, support) for v in support)
    exact = sum(mu[a] * adv[a] * (w[a] * _score(theta, a, support) - mean_ws) for a in support)
    got = _expected(theta, log_mu, cfg, head, adv=lambda a: adv[a], pad=2)
    torch.testing.assert_close(got, exact, rtol=0, atol=1e-12)
    assert exact.abs().max() > 1e-3  # not trivially zero


@pytest.mark.parametrize("restriction", ["top_k", "top_p", "mask"])
def test_head_covering_the_support_with_mu_equal_pi_s_is_reinforce(restriction):
    theta = _logits(4)
    log_mu = _engine_mu(theta, restriction)
    support = _support(log_mu)
    for a in support:
        centered = _estimator_grad(theta, a, log_mu, CENTERING, _head(log_mu, len(support)))
        plain = _estimator_grad(
            theta, a, log_mu, EstimatorConfig(type="reinforce"), _head(log_mu, len(support))
        )
        torch.testing.assert_close(centered, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiny_pi_tail_with_a_large_mu_tail_stays_centered(dtype):
    """1 - sum_H pi = 3.5e-9, 1 - sum_H mu = 0.05 (alpha ~ 1.4e7): a floor on the denominator
    (or a cancellation of alpha against the head) breaks the zero mean."""
    head = [0, 1, 2]
    theta = torch.full((V,), 0.0)
    theta[head] = torch.tensor([1.0, 0.5, 0.0])
    theta[3:] = torch.log(torch.tensor(3.5e-9) * theta[head].exp().sum() / (V - 3))  # tail mass 3.5e-9
    pi = theta.softmax(0)
    assert abs((1 - pi[head].sum()) / 3.5e-9 - 1) < 1e-3
    mu = torch.zeros(V)
    mu[head] = torch.tensor([0.5, 0.3, 0.15])
    mu[3:] = 0.05 * pi[3:] / pi[3:].sum()
    theta, log_mu = theta.to(dtype), mu.log().to(dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        g = _expected(theta, log_mu, CENTERING, head)
    finally:
        torch.set_default_dtype(previous)
    assert g.abs().max() < (1e-12 if dtype == torch.float64 else 1e-5), g


def test_bernoulli_kl_in_log_space_matches_exact_values_near_one():
    def exact(p, q):
        return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

    for p, q in ((0.5, 0.25), (0.95, 1 - 3.5e-9), (1 - 1e-7, 1 - 1e-9), (0.3, 1e-9)):
        got = bernoulli_kl(torch.tensor([math.log(p)]), torch.tensor([math.log(q)])).item()
        assert got == pytest.approx(exact(p, q), rel=1e-6), (p, q)
    # q = 1 with p < 1: infinite (the trajectory is dropped), never nan; p = 1: only its first term
    assert bernoulli_kl(torch.tensor([math.log(0.5)]), torch.tensor([0.0])).item() == math.inf
    assert bernoulli_kl(torch.tensor([0.0]), torch.tensor([math.log(0.5)])).item() == pytest.approx(
        math.log(2)
    )


def test_trust_region_keeps_a_trajectory_whose_pi_rounds_to_one_in_float32():
    """pi_S(a) = 1 - 3e-8 (log pi_S(a) rounds to 0.0 in float32), mu(a) = 1 - 1e-6: the true
    Bernoulli-KL is 2.5e-6, far below delta; reading pi(a) = 1 would make it +inf and drop it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        theta = torch.zeros(V)
        theta[0] = math.log((1 - 3e-8) / 3e-8 * (V - 1))  # pi(0) = 1 - 3e-8
        log_mu = torch.full((V,), math.log(1e-6 / (V - 1)))
        log_mu[0] = math.log1p(-1e-6)
        x = token_inputs(theta, [0], log_mu, head=list(range(V)))
        assert x.logprobs.item() == 0.0  # the float32 rounding the estimator must not trust
        _, diag = objective(x, EstimatorConfig(type="token_is", trust_region=True, trust_region_delta=3e-3))
        assert not diag["dropped"].any()
        kl = bernoulli_kl(x.deployment_logprobs.double(), x.logprobs.double(), x.complement_logprobs.double())
        p, q_rest = log_mu[0].double().exp().item(), theta.double().softmax(0)[1:].sum().item()
        exact = p * math.log(p / (1 - q_rest)) + (1 - p) * math.log((1 - p) / q_rest)  # float64, by hand
        assert kl.item() == pytest.approx(exact, rel=1e-3) and 1e-6 < exact < 1e-5
    finally:
        torch.set_default_dtype(previous)
