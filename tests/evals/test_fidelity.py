"""Gradient fidelity (evals/fidelity.py): the exact gradient against autograd of J through a tiny
model, the estimators' expected updates against independent enumerations, and the cell statistics
against explicit gradient vectors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from prodrl_pipeline.evals.fidelity import (
    CellStats,
    Decision,
    Policies,
    decision_logits,
    estimator_coefficients,
    exact_coefficients,
    logit_jacobian,
    second_moment,
    summarize,
    support_logprobs,
)
from prodrl_pipeline.evals.fidelity_report import SCHEDULES
from prodrl_pipeline.evals.fidelity_study import ENGINES, ESTIMATORS, STALENESS, SUPPORTS
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.rl.estimators import EstimatorConfig
from tests.conftest import TINY, rounding_tolerance

VOCAB = 16
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0], dtype=torch.float64)


def _decision() -> Decision:
    return Decision((1, 4, 2, 9, 3), torch.tensor([3, 5, 7, 9, 11, 13]), REWARDS)


def _flat_grad(model: torch.nn.Module, value: torch.Tensor) -> torch.Tensor:
    grads = torch.autograd.grad(value, list(model.parameters()), retain_graph=True, allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).flatten()
            for g, p in zip(grads, model.parameters(), strict=True)
        ]
    )


@pytest.mark.parametrize("top_k", [0, 3])
def test_exact_gradient_is_autograd_of_the_expected_reward(top_k: int) -> None:
    """Z^T c (the enumerated sum_a pi_S(a) R(a) grad log pi_S(a)) = autograd of sum_a pi_S(a) R(a)
    through the model, with S all of M and with S a top-3 of it."""
    model = build_model(TinyQwen3Config(**{**TINY.__dict__, "seed": 5}), VOCAB, 0).eval()
    d = _decision()
    with torch.no_grad():
        kept = torch.isfinite(support_logprobs(decision_logits(model, d), top_k))
    jac = logit_jacobian(model, d)  # [|M|, P]
    z = decision_logits(model, d)
    coef = exact_coefficients(z.detach(), kept, d.rewards)
    ours = (coef @ jac.double()).float()
    pi_s = z.masked_fill(~kept, float("-inf")).softmax(-1)
    reference = _flat_grad(model, (pi_s * d.rewards.float()).sum())
    # each entry sums |M| products Z_vp c_v, each itself a backward sum over positions x hidden units
    tol = rounding_tolerance(
        float(jac.abs().max() * coef.abs().sum()), len(d.prompt_ids) * TINY.hidden_size * len(kept)
    )
    assert (ours - reference).abs().max() <= tol
    # power to fail: the gradient of pi over all of M (no renormalization over S) is far off when S != M
    pi = z.softmax(-1)
    unrenormalized = _flat_grad(model, (pi * kept * d.rewards.float()).sum())
    if top_k:
        assert (unrenormalized - reference).abs().max() > 100 * tol


def _policies(seed: int, size: int = 6) -> Policies:
    g = torch.Generator().manual_seed(seed)
    current, round_start, deployment, reference = torch.randn(4, size, generator=g, dtype=torch.float64)
    return Policies(current, round_start, deployment, reference)


ON_POLICY = [
    EstimatorConfig(type="reinforce"),
    EstimatorConfig(type="token_is"),
    EstimatorConfig(type="tis_ppo"),
    EstimatorConfig(type="ref_is"),
    EstimatorConfig(type="score_centering"),
    EstimatorConfig(type="score_centering", centering="samples"),
    EstimatorConfig(type="score_centering", truncated_is=True),
]


@pytest.mark.parametrize("cfg", ON_POLICY, ids=lambda c: f"{c.type}-{c.centering}-{c.truncated_is}")
@pytest.mark.parametrize("top_k", [0, 4])
def test_on_policy_every_estimator_expects_the_exact_gradient(cfg: EstimatorConfig, top_k: int) -> None:
    """No mismatch (mu = pi_k = pi = reference, head covering S): each estimator's expected update is
    grad J exactly, whatever the baseline (E_pi_S[grad log pi_S] = 0)."""
    p = _policies(0)
    same = Policies(p.current, p.current, p.current, p.current)
    log_mu = support_logprobs(p.current.float(), top_k).double()
    kept = torch.isfinite(log_mu)
    log_mu = p.current.masked_fill(~kept, float("-inf")).log_softmax(-1)  # mu = pi_S in float64
    coef, w = estimator_coefficients(cfg, same, log_mu, REWARDS, baseline=0.37, head_size=6)
    assert torch.allclose(w @ coef, exact_coefficients(p.current, kept, REWARDS), atol=1e-12, rtol=0)


def _score(log_pi_s: torch.Tensor, z: torch.Tensor, a: int) -> torch.Tensor:
    (g,) = torch.autograd.grad(log_pi_s[a], z, retain_graph=True)
    return g


@pytest.mark.parametrize("centering", ["head", "samples"])
def test_score_centering_expects_the_rollout_covariance(centering: str) -> None:
    """Off-policy (mu != pi), head covering S: E_mu[A (s_a - E_mu s)] with s = grad_z log pi_S, by
    per-token autograd and explicit sums; it does not depend on the baseline, and differs from grad J(pi)."""
    p = _policies(1)
    log_mu = support_logprobs(p.deployment.float(), top_k=4).double()
    kept = torch.isfinite(log_mu)
    log_mu = p.deployment.masked_fill(~kept, float("-inf")).log_softmax(-1)
    mu = log_mu.exp()
    z = p.current.clone().requires_grad_(True)
    log_pi_s = z.masked_fill(~kept, float("-inf")).log_softmax(-1)
    support = kept.nonzero()[:, 0].tolist()
    scores = {a: _score(log_pi_s, z, a) for a in support}
    centre = sum(mu[v] * scores[v] for v in support)
    brute = sum(mu[a] * REWARDS[a] * (scores[a] - centre) for a in support)
    cfg = EstimatorConfig(type="score_centering", centering=centering)
    for baseline in (0.0, 0.8):
        coef, w = estimator_coefficients(cfg, p, log_mu, REWARDS, baseline, head_size=6)
        assert torch.allclose(w @ coef, brute, atol=1e-12, rtol=0)
    assert (brute - exact_coefficients(p.current, kept, REWARDS)).abs().max() > 1e-3


def test_cell_statistics_match_explicit_gradient_vectors() -> None:
    """Cosine, relative bias and minibatch variance from the Gram bookkeeping = the same from explicit
    per-(state, token) gradient vectors Z_s^T C_s[a] (iid draws: state uniform, token ~ w)."""
    g = torch.Generator().manual_seed(2)
    sizes, dim, batch = [3, 5, 4], 40, 8
    jac = [torch.randn(m, dim, generator=g, dtype=torch.float64) for m in sizes]
    coefs = [torch.randn(m, m, generator=g, dtype=torch.float64) for m in sizes]
    weights = [torch.rand(m, generator=g, dtype=torch.float64) for m in sizes]
    weights = [w / w.sum() for w in weights]
    exact = [torch.randn(m, generator=g, dtype=torch.float64) for m in sizes]
    stacked = torch.cat(jac)
    gram = stacked @ stacked.T
    offsets = np.cumsum([0, *sizes])
    cell = CellStats(
        [w @ c for w, c in zip(weights, coefs, strict=True)],
        exact,
        np.array(
            [
                second_moment(c, w, gram[a:b, a:b])
                for c, w, a, b in zip(coefs, weights, offsets, offsets[1:], strict=False)
            ]
        ),
    )
    got = summarize(cell, gram, batch, n_boot=20)
    vectors = [c @ z for c, z in zip(coefs, jac, strict=True)]  # per state [m, dim]
    expected = torch.stack([w @ v for w, v in zip(weights, vectors, strict=True)]).mean(0)
    truth = torch.stack([x @ z for x, z in zip(exact, jac, strict=True)]).mean(0)
    var = sum(
        float((w * ((v - expected) ** 2).sum(-1)).sum()) for w, v in zip(weights, vectors, strict=True)
    ) / len(sizes)
    assert got["cosine"] == pytest.approx(
        float(expected @ truth / (expected.norm() * truth.norm())), abs=1e-12
    )
    assert got["relative_bias"] == pytest.approx(float((expected - truth).norm() / truth.norm()), abs=1e-12)
    assert got["relative_variance"] == pytest.approx(var / batch / float(truth @ truth), abs=1e-12)
    assert got["cosine_lo"] <= got["cosine_hi"]


@pytest.mark.slow
def test_the_fidelity_command(tmp_path: Path) -> None:
    """The documented command on 2 states and S = 2: every cell is there, and with no mismatch (fp32
    engine, full support, theta = theta_k) every estimator without KL expects grad J: its bias is
    float32 rounding of the log-probs mu and pi_S are computed from, summed over the legal moves."""
    tokenizer = AutoTokenizer.from_pretrained("data/tokenizer")
    build_model(TinyQwen3Config(), len(tokenizer), tokenizer.pad_token_id).save_pretrained(tmp_path / "base")
    out = tmp_path / "fidelity"
    args = ["--states", "2", "--steps", "2", "--bootstrap", "20", "--out", str(out)]
    args += ["--checkpoint", str(tmp_path / "base")]  # no warm start: a random init serves as theta_k
    subprocess.run(
        [sys.executable, "-m", "prodrl_pipeline.evals.fidelity_study", *args], check=True, timeout=1800
    )
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == len(ESTIMATORS) * len(STALENESS) * len(ENGINES) * len(SUPPORTS) * len(SCHEDULES)
    exact_engine = [
        r for r in rows if r["engine"] == "fp32" and r["support"] == "full" and "kl" not in r["estimator"]
    ]
    on_policy = [r for r in exact_engine if r["schedule"] == "sync" and r["staleness_steps"] == 0]
    assert len(on_policy) == len(ESTIMATORS) // 2
    tol = 50 * rounding_tolerance(math.log(50), TinyQwen3Config().hidden_size)  # |log p| <= log|M|, |M| <= 50
    assert all(r["relative_bias"] <= tol for r in on_policy), on_policy
    # token IS reweights each sampled token by pi / mu: unbiased for grad J at any staleness, async too
    token_is = [r for r in exact_engine if r["estimator"] == "token_is"]
    assert len(token_is) == len(STALENESS) * len(SCHEDULES)
    assert all(r["relative_bias"] <= tol for r in token_is), token_is
    behind = {r["schedule"]: r["round_start_drift"] for r in rows}
    assert behind["sync"] == 0 and behind["async1"] > 0  # async1's pi_k is S steps from the deployment
    assert "## Gradient fidelity" in out.with_suffix(".md").read_text()
    for schedule in SCHEDULES:  # its figures, linked from the markdown beside them
        assert f"(./fidelity_{schedule}_cosine.png)" in out.with_suffix(".md").read_text()
        assert (tmp_path / f"fidelity_{schedule}_relative_variance.png").read_bytes()[:4] == b"\x89PNG"


def test_the_recommendation_follows_its_stated_rule_on_known_rows() -> None:
    """Worst cosine within one round of staleness among estimators within the variance budget; a
    tie goes to the lower variance; cells past S and +kl estimators do not count."""
    from prodrl_pipeline.evals.fidelity_report import recommendation

    def row(name, steps, cos, var, schedule="sync"):  # noqa: ANN001, ANN202
        return {
            "estimator": name,
            "staleness_steps": steps,
            "schedule": schedule,
            "engine": "fp32",
            "support": "full",
            "cosine": cos,
            "relative_variance": var,
        }

    rows = [
        *(row("unbiased", s, 1.0, v) for s, v in ((0, 1.0), (8, 3.0), (16, 9.0))),  # 9x: excluded
        *(row("centered", s, c, 1.0) for s, c in ((0, 1.0), (8, 0.9), (16, 0.7))),
        *(row("twin", s, c, 2.0) for s, c in ((0, 1.0), (8, 0.9), (16, 0.7))),  # same cos, more var
        *(row("clipped", s, c, 1.0) for s, c in ((0, 1.0), (8, -0.1), (16, 0.5))),
        row("centered", 32, -1.0, 50.0),  # beyond S: not counted
        row("centered+kl", 16, 1.0, 1.0),
    ]
    text = recommendation(rows, steps=16)
    assert text.splitlines()[2].startswith("**centered.**") and "at least 0.70" in text
    table = {
        line.split(" | ")[0].strip("| "): line.rsplit(" | ", 1)[1].strip(" |")
        for line in text.splitlines()
        if line.startswith("| ") and "estimator" not in line
    }
    assert table == {
        "unbiased": "variance beyond 4x",
        "centered": "recommended",
        "twin": "same cosine, more variance",
        "clipped": "lower worst cosine",
    }
