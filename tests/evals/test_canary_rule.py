"""The production gate's statistics and rule (evals/canary.py) and its routing rule, by hand."""

import math

import pytest

from prodrl_pipeline.evals.canary import CanaryConfig, judge, welch_difference
from prodrl_pipeline.gateway.deployments import candidate_arm

T_95_DF4 = 2.131847  # Student's t, one-sided 95%, 4 degrees of freedom (printed tables)


def test_welch_difference_by_hand():
    """candidate 2, 4, 6 (mean 4, s^2 4); control 1, 3, 5 (mean 3, s^2 4): d = 1,
    SE = sqrt(4/3 + 4/3), nu = (8/3)^2 / ((4/3)^2/2 + (4/3)^2/2) = 4."""
    d = welch_difference([2.0, 4.0, 6.0], [1.0, 3.0, 5.0])
    assert (d.mean_candidate, d.mean_control, d.diff) == (4.0, 3.0, 1.0)
    assert d.se == pytest.approx(math.sqrt(8 / 3))
    assert d.df == pytest.approx(4.0)
    assert d.lower_bound(0.95) == pytest.approx(1 - T_95_DF4 * math.sqrt(8 / 3), abs=1e-6)
    low, high = d.interval(0.90)  # the two-sided 90% interval has the one-sided 95% bound as its low end
    assert low == pytest.approx(d.lower_bound(0.95)) and high == pytest.approx(
        1 + T_95_DF4 * math.sqrt(8 / 3)
    )


def test_unequal_arms_weight_each_variance_by_its_own_n():
    """candidate 0, 0, 1, 1 (s^2 1/3, n 4); control 0 x3, 1 x3 (s^2 0.3, n 6): a = 1/12, b = 0.05,
    nu = (a + b)^2 / (a^2/3 + b^2/5) (Welch-Satterthwaite, not n_c + n_l - 2 = 8)."""
    d = welch_difference([0, 0, 1, 1], [0, 0, 0, 1, 1, 1])
    a, b = 1 / 12, 0.05
    assert d.diff == 0.0 and d.se == pytest.approx(math.sqrt(a + b))
    assert d.df == pytest.approx((a + b) ** 2 / (a**2 / 3 + b**2 / 5))
    assert d.df < 8


def test_constant_rewards_have_no_spread():
    d = welch_difference([1.0, 1.0], [0.0, 0.0])
    assert d.se == 0 and d.lower_bound(0.95) == d.diff == 1.0


CFG = CanaryConfig(share=0.5, margin=0.1, confidence=0.95, min_per_arm=4, max_wait_hours=2.0)


def test_the_rule_waits_for_the_minimum_sample_then_rolls_back_at_the_maximum_wait():
    v = judge(CFG, [1, 1, 1], [1, 1, 1, 1, 1], waited_seconds=3600)
    assert v.decision == "wait" and "3 candidate / 5 control" in v.reason and v.difference is None
    v = judge(CFG, [1, 1, 1], [1, 1, 1, 1, 1], waited_seconds=2 * 3600)
    assert v.decision == "roll_back" and "after 2.00 h" in v.reason
    v = judge(CFG, [], [], waited_seconds=7200)  # no reward ever arrived
    assert v.decision == "roll_back" and v.numbers()["n_candidate"] == 0


def test_equal_is_promoted_under_the_margin_worse_is_rolled_back():
    control = [0, 1] * 100  # mean 0.5; SE of an equal arm's difference 0.05, bound -0.083
    equal = judge(CFG, [1, 0] * 100, control, waited_seconds=0)
    assert equal.decision == "promote" and equal.difference.diff == 0
    assert -CFG.margin <= equal.lower_bound < 0  # not better, and within the margin
    worse = judge(CFG, [0, 0, 0, 1] * 50, control, waited_seconds=0)  # mean 0.25
    assert worse.decision == "roll_back" and worse.lower_bound < -CFG.margin
    assert worse.numbers()["diff"] == pytest.approx(-0.25)
    slightly_worse = judge(CFG, [0, 1] * 98 + [0, 0] * 2, control, waited_seconds=0)  # -0.01: noise
    assert slightly_worse.decision == "promote"


def test_the_decision_is_on_the_bound_not_the_point_estimate():
    """d = -0.05 is inside the margin, but 4 rewards per arm cannot show it: rolled back."""
    v = judge(CFG, [0.4, 0.5, 0.6, 0.3], [0.5, 0.4, 0.6, 0.5], waited_seconds=0)
    assert -CFG.margin < v.difference.diff == pytest.approx(-0.05)
    assert v.decision == "roll_back" and v.lower_bound < -CFG.margin


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("share", 0.0, "share must be in (0, 1)"),
        ("share", 1.0, "share must be in (0, 1)"),
        ("margin", -0.1, "margin must be >= 0"),
        ("margin", math.nan, "margin must be >= 0"),
        ("confidence", 1.0, "confidence must be in (0, 1)"),
        ("min_per_arm", 1, "min_per_arm must be >= 2"),
        ("max_wait_hours", 0.0, "max_wait_hours must be > 0"),
        ("max_wait_hours", math.inf, "max_wait_hours must be > 0 and finite"),
    ],
)
def test_invalid_settings_are_refused_with_what_to_change(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CanaryConfig(**{field: value})


def test_routing_is_stable_per_trajectory_and_respects_the_share():
    ids = [f"user-{i}" for i in range(20_000)]
    routed = [candidate_arm("main-r000001.1", t, 0.25) for t in ids]
    assert routed == [candidate_arm("main-r000001.1", t, 0.25) for t in ids]  # stable
    share = sum(routed) / len(ids)
    assert abs(share - 0.25) < 4 * math.sqrt(0.25 * 0.75 / len(ids))  # binomial, 4 sigma
    other = [candidate_arm("main-r000002.1", t, 0.25) for t in ids]  # another canary draws anew
    both = sum(a and b for a, b in zip(routed, other, strict=True)) / len(ids)
    assert abs(both - 0.25**2) < 4 * math.sqrt(0.0625 * 0.9375 / len(ids))
    nested = [candidate_arm("main-r000001.1", t, 0.5) for t in ids]  # a larger share keeps the smaller's
    assert all(n for r, n in zip(routed, nested, strict=True) if r)


def test_a_reward_too_large_to_square_rolls_the_canary_back_instead_of_raising():
    """The feedback endpoint accepts any finite reward; 1e200 squared overflows. The rule still
    decides: the statistics are not finite, so the candidate is rolled back, saying why."""
    config = CanaryConfig(min_per_arm=3)
    for candidate, control in (([0.5, 0.5, 1e200], [0.5, 0.4, 0.6]), ([0.5, 0.4, 0.6], [1e200, -1e200, 0.0])):
        verdict = judge(config, candidate, control, waited_seconds=0.0)
        assert verdict.decision == "roll_back" and "not finite" in verdict.reason, verdict
