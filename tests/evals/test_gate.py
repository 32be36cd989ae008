import math
from statistics import NormalDist

import pytest

from prodrl_pipeline.evals.gate import deploy_gate, paired_difference


def _rows(solved: list[int]) -> dict[str, bool]:
    return {f"p{i}": bool(s) for i, s in enumerate(solved)}


def test_hand_computed_paired_bound():
    live = _rows([1] * 50 + [0] * 50)
    cand = _rows([1] * 40 + [0] * 10 + [0] * 50)  # 10 regressions, no gains: d = -0.1
    r = deploy_gate(cand, live, margin=0.02, confidence=0.95)
    sd = math.sqrt((10 * (-1 + 0.1) ** 2 + 90 * 0.1**2) / 99)
    assert r.diff == pytest.approx(-0.1)
    assert r.upper_bound == pytest.approx(-0.1 + NormalDist().inv_cdf(0.95) * sd / 10)
    assert not r.passed and "FAILS" in r.reason()


def test_equal_or_noisy_candidates_pass():
    live = _rows([1, 0] * 50)
    assert deploy_gate(live, live).passed
    noisy = _rows([1, 0] * 49 + [0, 0])  # one puzzle lost out of 100: not evidence of a regression
    assert deploy_gate(noisy, live, margin=0.02).passed


def test_the_gate_decides_on_its_bound_not_its_point_estimate():
    live = _rows([1] * 30)
    one_lost = _rows([1] * 29 + [0])  # d = -0.033, below -margin, but 30 puzzles cannot show it
    r = deploy_gate(one_lost, live, margin=0.02, confidence=0.95)
    assert r.diff < -0.02 < r.upper_bound and r.passed
    many_lost = _rows([1] * 900 + [0] * 100)
    r = deploy_gate(many_lost, _rows([1] * 1000), margin=0.02, confidence=0.95)
    assert r.upper_bound < -0.02 and not r.passed


def test_only_shared_puzzles_count_and_bad_arguments():
    r = deploy_gate({"a": True, "b": False}, {"a": True, "c": True})
    assert r.n == 1
    with pytest.raises(ValueError):
        deploy_gate({"a": True}, {"b": True})
    with pytest.raises(ValueError):
        deploy_gate({"a": True}, {"a": True}, confidence=1.5)


def test_paired_difference_interval_by_hand():
    base = _rows([1] * 30 + [0] * 70)
    run = _rows([1] * 25 + [0] * 5 + [1] * 20 + [0] * 50)  # 5 lost, 20 gained: d = +0.15
    p = paired_difference(run, base)
    sd = math.sqrt((20 * (1 - 0.15) ** 2 + 5 * (-1 - 0.15) ** 2 + 75 * 0.15**2) / 99)
    lo, hi = p.interval(0.95)
    assert p.diff == pytest.approx(0.15) and p.rate == pytest.approx(0.45) and p.baseline_rate == 0.3
    assert (lo, hi) == pytest.approx((0.15 - 1.959964 * sd / 10, 0.15 + 1.959964 * sd / 10))


def test_the_gate_reason_says_what_it_decided_on():
    live = _rows([1] * 10)
    r = deploy_gate(_rows([1] * 10), live)
    assert r.reason() == (
        "gate passes: candidate 1.000 vs live 1.000 on 10 paired puzzles; diff +0.000, "
        "upper bound +0.000 vs -margin -0.020"
    )
    r = deploy_gate(_rows([0] * 10), live, margin=0.5)
    assert r.reason() == (
        "gate FAILS: candidate 0.000 vs live 1.000 on 10 paired puzzles; diff -1.000, "
        "upper bound -1.000 vs -margin -0.500"
    )


def test_the_gate_edges_a_bound_at_minus_margin_passes_and_tiny_samples():
    # every puzzle lost: d_i = -1 with no spread, so the bound is exactly -1
    r = deploy_gate(_rows([0] * 4), _rows([1] * 4), margin=1.0)
    assert r.upper_bound == -1.0 and r.passed  # not worse than the margin allows
    assert not deploy_gate(_rows([0] * 4), _rows([1] * 4), margin=0.999).passed
    assert deploy_gate(_rows([1]), _rows([1]), margin=0.0).passed  # margin 0 is allowed
    one = paired_difference(_rows([0]), _rows([1]))  # a single pair has no spread to estimate
    assert (one.n, one.diff, one.se) == (1, -1.0, 0.0)
    two = paired_difference(_rows([0, 1]), _rows([1, 1]))  # d = (-1, 0): s_d = sqrt(0.5)
    assert two.se == pytest.approx(math.sqrt(0.5) / math.sqrt(2))
    assert two.interval() == pytest.approx(two.interval(0.95))  # 95% unless told otherwise
    assert deploy_gate(_rows([1] * 49 + [0]), _rows([1] * 50)).margin == 0.02


@pytest.mark.parametrize(("confidence", "margin"), [(0.0, 0.02), (1.0, 0.02), (0.95, -0.01)])
def test_the_gate_refuses_arguments_it_cannot_honour(confidence, margin):
    with pytest.raises(
        ValueError, match=rf"need 0 < confidence < 1 and margin >= 0, got {confidence}, {margin}"
    ):
        deploy_gate(_rows([1]), _rows([1]), margin=margin, confidence=confidence)
    with pytest.raises(ValueError, match="^the two deployments share no evaluated puzzle$"):
        paired_difference({"a": True}, {"b": True})
