"""Estimators against independent references on a tiny vocabulary (V = 12, explicit distributions)."""

import math

import pytest
import torch

from prodrl_pipeline.rl.estimators import EstimatorConfig, TokenInputs, kl_penalty, objective
from tests.rl.conftest import token_inputs

V = 12


@pytest.fixture(autouse=True)
def float64():
    """Identities are checked tightly in float64; the estimators are dtype-agnostic."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _dist(seed: int, scale: float = 1.5) -> torch.Tensor:
    return (
        torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    ).log_softmax(0)


def _inputs(theta, a, log_mu, log_pik=None, head=None, adv=1.0, pad=0):
    """Full support (S = V); the restricted supports are tested in test_restricted_support.py."""
    return token_inputs(theta, a, log_mu, head=head, log_pik=log_pik, adv=adv, pad=pad)


def _grad(fn, theta):
    theta = theta.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(theta), theta)
    return g


def _objective_grad(theta, a, log_mu, cfg, head=None, pad=0):
    """d J(a) / d theta for one sampled token a."""
    return _grad(lambda t: objective(_inputs(t, [a], log_mu, head=head, pad=pad), cfg)[0].sum(), theta)


def _score(theta, a):
    return _grad(lambda t: t.log_softmax(0)[a], theta)


CENTERING = EstimatorConfig(type="score_centering")


def test_score_centering_full_head_with_mu_equal_pi_is_reinforce():
    theta = _dist(0)
    log_mu = theta.log_softmax(0)
    for a in range(V):
        centered = _objective_grad(theta, a, log_mu, CENTERING)
        plain = _objective_grad(theta, a, log_mu, EstimatorConfig(type="reinforce"))
        torch.testing.assert_close(centered, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "cfg", [CENTERING, EstimatorConfig(type="score_centering", truncated_is=True, is_cap=1.3)]
)
def test_expected_centered_score_under_mu_is_zero(cfg):
    theta, log_mu = _dist(1), _dist(2)
    expected = sum(log_mu[a].exp() * _objective_grad(theta, a, log_mu, cfg) for a in range(V))
    assert expected.abs().max() < 1e-12
    # and it is not zero without centering: the test can fail
    plain = sum(log_mu[a].exp() * _score(theta, a) for a in range(V))
    assert plain.abs().max() > 1e-2


@pytest.mark.parametrize("pad", [0, 3])
def test_tail_modelled_head_equals_exact_centering_when_the_tail_model_is_exact(pad):
    """Also with the head padded (a microbatch mixing head lengths): padding must not count."""
    theta = _dist(3)
    pi = theta.softmax(0)
    head = torch.tensor([0, 3, 5, 7, 8])
    tail = torch.tensor([i for i in range(V) if i not in head.tolist()])
    mu = torch.zeros(V)
    mu[head] = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.05])  # mass 0.8 in the head
    mu[tail] = 0.2 * pi[tail] / pi[tail].sum()  # outside H, mu = alpha * pi exactly
    log_mu = mu.log()
    for a in range(V):
        head_form = _objective_grad(theta, a, log_mu, CENTERING, head=head, pad=pad)
        exact = _score(theta, a) - sum(mu[v] * _score(theta, v) for v in range(V))
        torch.testing.assert_close(head_form, exact, rtol=0, atol=1e-12)


def test_truncated_centering_with_a_partial_head_has_zero_expectation_under_mu():
    """The alpha' branch: exact modelled tail, C alpha' on either side of 1."""
    theta = _dist(8)
    pi = theta.softmax(0)
    head = torch.tensor([1, 2, 4])
    tail = torch.tensor([i for i in range(V) if i not in head.tolist()])
    mu = torch.zeros(V)
    mu[head] = torch.tensor([0.4, 0.25, 0.15])
    mu[tail] = 0.2 * pi[tail] / pi[tail].sum()
    for cap in (1.1, 50.0):
        cfg = EstimatorConfig(type="score_centering", truncated_is=True, is_cap=cap)
        expected = sum(mu[a] * _objective_grad(theta, a, mu.log(), cfg, head=head, pad=2) for a in range(V))
        assert expected.abs().max() < 1e-12, cap


def test_centering_changes_the_gradient_when_mu_differs_from_pi():
    theta, log_mu = _dist(0), _dist(9)
    assert (
        _objective_grad(theta, 2, log_mu, CENTERING)
        - _objective_grad(theta, 2, log_mu, EstimatorConfig(type="reinforce"))
    ).abs().max() > 1e-3


def test_forced_token_contributes_nothing_to_score_centering():
    theta = _dist(4)
    log_mu = torch.full((V,), -math.inf)
    log_mu[6] = 0.0  # mu puts all its mass on token 6: a forced token
    g = _grad(lambda t: objective(_inputs(t, [6], log_mu, head=[6]), CENTERING)[0].sum(), theta)
    assert g.abs().max() < 1e-12


def test_sampled_kl_gradient_matches_exact_kl_gradient():
    theta, log_mu, log_pik = _dist(5), _dist(6), _dist(7)

    def per_token(a):
        return _grad(lambda t: kl_penalty(_inputs(t, [a], log_mu, log_pik)).sum(), theta)

    grads = torch.stack([per_token(a) for a in range(V)])  # [V, V]: gradient of each token's term
    mu = log_mu.exp()
    exact = _grad(lambda t: (t.softmax(0) * (t.log_softmax(0) - log_pik)).sum(), theta)  # grad KL(pi || pi_k)
    torch.testing.assert_close(mu @ grads, exact, rtol=0, atol=1e-12)  # the identity, in expectation
    n = 20_000
    draws = torch.multinomial(mu, n, replacement=True, generator=torch.Generator().manual_seed(0))
    mc = grads[draws].mean(0)
    std = (mu[:, None] * (grads - mu @ grads) ** 2).sum(0).sqrt()
    assert torch.all((mc - exact).abs() <= 5 * std / math.sqrt(n) + 1e-9)


def test_tis_ppo_hand_computed_example_with_both_clip_sides_and_truncation():
    cfg = EstimatorConfig(type="tis_ppo", is_cap=2.0, eps_low=0.2, eps_high=0.28)
    # per token: log pi, log pi_k, log mu, A
    lp = torch.log(torch.tensor([0.30, 0.10, 0.22, 0.30, 0.20])).requires_grad_(True)
    lpk = torch.log(torch.tensor([0.20, 0.20, 0.20, 0.20, 0.20]))
    lmu = torch.log(torch.tensor([0.05, 0.20, 0.40, 0.20, 0.25]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    x = TokenInputs(lp, lmu, lpk, adv, torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.bool))
    j, diag = objective(x, cfg)
    # rho = min(pi_k/mu, 2) = [2 (4, truncated), 1, 0.5, 1, 0.8]; r = pi/pi_k = [1.5, 0.5, 1.1, 1.5, 1.0]
    # token 0: A>0, r>1.28 -> clipped: 2*1.28;  token 1: A<0, r<0.8 -> clipped: 1*(-0.8)
    # token 2: inside: 0.5*1.1;  token 3: A<0, r>1.28 -> min picks unclipped: -1.5;  token 4: 0.8*1.0
    torch.testing.assert_close(j, torch.tensor([2.56, -0.8, 0.55, -1.5, 0.8]))
    assert diag["clipped"].tolist() == [True, True, False, False, False]
    assert diag["rho_truncated"].tolist() == [True, False, False, False, False]
    (g,) = torch.autograd.grad(j.sum(), lp)
    # dJ/dlog pi = rho * r * A where unclipped, 0 where clipped
    torch.testing.assert_close(g, torch.tensor([0.0, 0.0, 0.5 * 1.1, -1.5, 0.8]))


def test_token_is_weight_and_sequence_trust_region():
    lp = torch.log(torch.tensor([0.5, 0.5, 0.4, 0.9])).requires_grad_(True)
    lmu = torch.log(torch.tensor([0.5, 0.25, 0.4, 0.3]))
    traj = torch.tensor([0, 0, 1, 1])
    x = TokenInputs(lp, lmu, lp.detach(), torch.ones(4), traj, torch.ones(4, dtype=torch.bool))
    x.complement_logprobs = torch.log1p(-lp.detach().exp())
    j, _ = objective(x, EstimatorConfig(type="token_is"))
    (g,) = torch.autograd.grad(j.sum(), lp)
    torch.testing.assert_close(g, torch.tensor([1.0, 2.0, 1.0, 3.0]))  # sg(pi/mu) * A
    # mean Bernoulli-KL(mu(a), pi(a)) per trajectory, by hand
    bkl = lambda m, p: m * math.log(m / p) + (1 - m) * math.log((1 - m) / (1 - p))  # noqa: E731
    kl0 = (bkl(0.5, 0.5) + bkl(0.25, 0.5)) / 2
    kl1 = (bkl(0.4, 0.4) + bkl(0.3, 0.9)) / 2
    for delta, dropped in ((kl1 * (1 - 1e-6), True), (kl1 * (1 + 1e-6), False)):  # the boundary, exactly
        _, diag = objective(x, EstimatorConfig(type="token_is", trust_region=True, trust_region_delta=delta))
        assert diag["dropped"].tolist() == [kl0 > delta] * 2 + [dropped] * 2
    # a forced token (not free) does not enter its trajectory's mean
    x.free = torch.tensor([True, True, True, False])
    _, diag = objective(
        x, EstimatorConfig(type="token_is", trust_region=True, trust_region_delta=bkl(0.4, 0.4) + 1e-9)
    )
    assert diag["dropped"].tolist() == [True, True, False, False]


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            {"type": "ppo"},
            "^estimator type 'ppo' unknown; choose one of "
            r"\['ref_is', 'reinforce', 'score_centering', 'tis_ppo', 'token_is'\]$",
        ),
        ({"is_cap": 0}, "^is_cap must be > 0, got 0$"),
        ({"eps_low": 1.0}, "^need 0 <= eps_low < 1 and eps_high >= 0, got 1.0, 0.28$"),
        ({"eps_low": -0.1}, "^need 0 <= eps_low < 1 and eps_high >= 0, got -0.1, 0.28$"),
        ({"eps_high": -0.1}, "^need 0 <= eps_low < 1 and eps_high >= 0, got 0.2, -0.1$"),
        ({"trust_region_delta": 0}, "^trust_region_delta must be > 0, got 0$"),
        ({"kl_beta": -1}, "^kl_beta must be >= 0, got -1$"),
        ({"type": "reinforce", "trust_region": True}, "^trust_region applies to type='token_is' only$"),
        (
            {"type": "tis_ppo", "truncated_is": True},
            "^truncated_is composes with type='score_centering', centering='head' only$",
        ),
        (
            {"centering": "samples", "truncated_is": True},
            "^truncated_is composes with type='score_centering', centering='head' only$",
        ),
        ({"type": "tis_ppo", "centering": "samples"}, "^centering applies to type='score_centering' only$"),
    ],
)
def test_invalid_configs_say_what_to_change(bad, match):
    with pytest.raises(ValueError, match=match):
        EstimatorConfig(**bad)


def test_configs_at_the_edges_of_their_ranges_are_accepted():
    default = EstimatorConfig()
    assert (default.type, default.centering, default.is_cap, default.eps_low, default.eps_high) == (
        "score_centering",
        "head",
        2.0,
        0.2,
        0.28,
    )
    assert (default.trust_region, default.trust_region_delta, default.truncated_is, default.kl_beta) == (
        False,
        3e-3,
        False,
        0.0,
    )
    EstimatorConfig(type="tis_ppo", eps_low=0.0, eps_high=0.0, kl_beta=0.0, is_cap=1e-3)
    EstimatorConfig(type="token_is", trust_region=True, trust_region_delta=1e-9)
    EstimatorConfig(type="score_centering", centering="head", truncated_is=True)
    EstimatorConfig(type="score_centering", centering="samples")


def test_ref_is_weights_by_the_reference_not_by_mu_and_kl_beta_pulls_toward_pi_k():
    lp = torch.log(torch.tensor([0.3, 0.3])).requires_grad_(True)
    lpk = torch.log(torch.tensor([0.3, 0.3]))
    lmu = torch.log(torch.tensor([0.6, 0.6]))  # pi_k / mu = 0.5
    ref = torch.log(torch.tensor([0.15, 0.15]))  # pi_k / ref = 2
    x = TokenInputs(
        lp,
        lmu,
        lpk,
        torch.ones(2),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2, dtype=torch.bool),
        reference_logprobs=ref,
    )
    (g_ref,) = torch.autograd.grad(objective(x, EstimatorConfig(type="ref_is", is_cap=5.0))[0].sum(), lp)
    (g_tis,) = torch.autograd.grad(objective(x, EstimatorConfig(type="tis_ppo", is_cap=5.0))[0].sum(), lp)
    torch.testing.assert_close(g_ref, torch.tensor([2.0, 2.0]))  # rho = pi_k / ref, r = 1
    torch.testing.assert_close(g_tis, torch.tensor([0.5, 0.5]))  # rho = pi_k / mu
    # the KL term is subtracted: where pi > pi_k, beta > 0 lowers log pi's gradient
    x.logprobs = torch.log(torch.tensor([0.5, 0.5])).requires_grad_(True)
    (g0,) = torch.autograd.grad(objective(x, EstimatorConfig(type="reinforce"))[0].sum(), x.logprobs)
    (g1,) = torch.autograd.grad(
        objective(x, EstimatorConfig(type="reinforce", kl_beta=0.5))[0].sum(), x.logprobs
    )
    assert torch.all(g1 < g0)


def test_the_trust_region_averages_over_free_tokens_and_keeps_a_trajectory_exactly_at_delta():
    from prodrl_pipeline.rl.estimators import bernoulli_kl

    lp = torch.log(torch.tensor([0.5, 0.5, 0.4, 0.9]))
    lmu = torch.log(torch.tensor([0.5, 0.25, 0.4, 0.3]))
    x = TokenInputs(
        lp, lmu, lp, torch.ones(4), torch.tensor([0, 0, 1, 1]), torch.tensor([True, True, False, True])
    )
    x.complement_logprobs = torch.log1p(-lp.exp())
    kl3 = bernoulli_kl(lmu[3:], lp[3:], x.complement_logprobs[3:])  # trajectory 1's only free token

    def dropped(delta: float) -> list[bool]:
        cfg = EstimatorConfig(type="token_is", trust_region=True, trust_region_delta=delta)
        return objective(x, cfg)[1]["dropped"].tolist()

    assert dropped(0.75 * float(kl3)) == [False, False, True, True]  # its mean is its one KL, not KL / 2
    assert dropped(float(kl3)) == [False, False, False, False]  # exactly at delta is inside the region
    x.complement_logprobs = None
    with pytest.raises(
        ValueError, match=r"^the trust region needs complement_logprobs, log\(1 - pi_S\(a\)\), from"
    ):
        dropped(1.0)


def test_bernoulli_kl_takes_log_q_from_the_side_where_it_is_exact():
    from prodrl_pipeline.rl.estimators import bernoulli_kl

    def by_hand(p, q_first, q_second):  # q as the first term reads it, 1 - q as the second does
        return p * math.log(p / q_first) + (1 - p) * math.log((1 - p) / q_second)

    lp = torch.log(torch.tensor([0.3, 0.3], dtype=torch.float64))
    # q < 1/2: log q is the one given; q > 1/2: it is log(1 - exp(log(1 - q))), from the complement
    log_q = torch.log(torch.tensor([0.2, 0.5], dtype=torch.float64))  # the second one inexact on purpose
    log1m_q = torch.log(torch.tensor([0.7, 0.4], dtype=torch.float64))
    got = bernoulli_kl(lp, log_q, log1m_q).tolist()
    assert got == pytest.approx([by_hand(0.3, 0.2, 0.7), by_hand(0.3, 0.6, 0.4)], rel=1e-12)
    # p = 0 and p = 1 have one term only (no 0 * log 0 = NaN)
    edge = bernoulli_kl(torch.tensor([-math.inf, 0.0]), torch.log(torch.tensor([0.25, 0.25])))
    assert edge.tolist() == pytest.approx([-math.log(0.75), -math.log(0.25)], rel=1e-6)


def test_ref_is_without_a_reference_says_where_it_comes_from():
    x = TokenInputs(
        *(torch.zeros(1) for _ in range(4)), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool)
    )
    with pytest.raises(
        ValueError,
        match=r"^ref_is needs reference_logprobs \(the trainer computes them from the deployment\)$",
    ):
        objective(x, EstimatorConfig(type="ref_is"))


def test_a_weight_exactly_at_the_cap_is_not_counted_truncated():
    lp = torch.log(torch.tensor([0.2, 0.2]))
    lmu = torch.log(torch.tensor([0.05, 0.1]))
    x = TokenInputs(
        lp, lmu, lp, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool)
    )
    at = float(torch.exp(lp[1] - lmu[1]))  # pi_k / mu of token 1, as the estimator computes it
    _, diag = objective(x, EstimatorConfig(type="tis_ppo", is_cap=at))
    assert diag["rho_truncated"].tolist() == [True, False]


def test_samples_centering_subtracts_the_mean_score_of_the_extra_samples():
    """grad J = A (s_a - (1/M) sum_m s(v_m)), s_v = e_v - softmax(theta): the softmax cancels."""
    theta = _dist(7)
    cfg = EstimatorConfig(type="score_centering", centering="samples")
    fn = lambda t: objective(token_inputs(t, [3], _dist(8), extra=[[1, 5, 5]], adv=-2.0), cfg)[0].sum()  # noqa: E731
    expected = -2.0 * (torch.eye(V)[3] - (torch.eye(V)[1] + 2 * torch.eye(V)[5]) / 3)
    torch.testing.assert_close(_grad(fn, theta), expected)
    for extra in (None, torch.zeros((1, 0), dtype=torch.long)):  # none recorded, or zero a position
        x = token_inputs(theta, [3], _dist(8), extra=extra)
        x.extra_logprobs = None if extra is None else x.extra_logprobs
        with pytest.raises(
            ValueError, match=r"^centering='samples' needs calls recorded with extra samples \(engine"
        ):
            objective(x, cfg)


def test_log1mexp_is_exact_near_zero_and_counts_inputs_above_zero_as_zero():
    from prodrl_pipeline.rl.estimators import log1mexp

    got = log1mexp(torch.tensor([-1e-10, -50.0, 0.0, 0.5], dtype=torch.float32))
    assert got[0].item() == pytest.approx(math.log(1e-10), rel=1e-6)  # 1 - e^x rounds to 0 in float32
    assert got[1].item() == pytest.approx(-math.exp(-50.0), rel=1e-6)
    assert got[2].item() == got[3].item() == -math.inf  # a mass rounded past 1 counts as 1


def test_score_centering_keeps_the_log_probs_dtype():
    torch.set_default_dtype(torch.float32)  # the trainer's (the fixture restores float64)
    x = token_inputs(_dist(1).float(), [2], _dist(2).float(), head=[2, 4])  # a partial head: a tail
    assert objective(x, CENTERING)[0].dtype == torch.float32


def test_ratios_are_clamped_at_e_to_the_plus_minus_20():
    from prodrl_pipeline.rl.estimators import MAX_LOG_RATIO, _ratio

    got = _ratio(torch.tensor([30.0, -30.0, 1.0]), torch.zeros(3))
    expected = torch.tensor([math.exp(MAX_LOG_RATIO), math.exp(-MAX_LOG_RATIO), math.e])
    torch.testing.assert_close(got, expected, atol=0.0, rtol=1e-6)  # relative: e^-20 is 2e-9


def test_truncated_centering_flags_weights_above_the_cap_only():
    theta, log_mu = _dist(3), _dist(4)
    x = _inputs(theta, [2, 5], log_mu)
    raw = torch.exp(x.logprobs - x.deployment_logprobs).detach()
    cfg = EstimatorConfig(type="score_centering", truncated_is=True, is_cap=float(raw[1]))
    assert objective(x, cfg)[1]["rho_truncated"].tolist() == [bool(raw[0] > raw[1]), False]
