"""The lab study (docs/results.md): named configurations, the comparisons between them, and the
statistics behind each verdict. No Dagster here; `assets/study.py` runs the configurations.

A configuration is a set of `LabResource` overrides. One that trains on another configuration's
traffic (`replay_of`) runs as a counterfactual replay in that configuration's store; every other one
collects its own traffic in its own store (traffic is per store and round). All share one base model.

Verdicts compare final-round held-out solve rates of two configurations, seed by seed on the same
puzzles: d_s = rate_A,s − rate_B,s. With two or more seeds the interval is Student's t over seeds
(df = n − 1), which carries run-to-run variance; with one seed it is the paired-puzzle interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

NO_WORSE_FRACTION = 0.25
""""Does not hurt": A - B's lower bound stays above minus this fraction of B's gain over the base
(a margin tied to what training achieves, not to a fixed number of points)."""
VARIANCE_ALPHA = 0.05  # "less variance": a one-sided F-test on the seeds' variances at this level
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
STUDY_DEFAULTS: Mapping[str, object] = {"gate_margin": 1.0}
"""Lab settings every configuration shares. The deploy gate is opened: a configuration that
regresses must still deploy and be measured (a held-back deployment would change its traffic)."""


def t975(df: int) -> float:
    """Student's t 97.5% quantile: exact to 3 decimals for df < 10, a Cornish-Fisher expansion above."""
    if df in _T975:
        return _T975[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class StudyConfig:
    name: str
    settings: Mapping[str, object] = field(default_factory=dict)
    """`LabResource` field overrides; `estimator` is a mapping of `EstimatorConfig` fields."""
    replay_of: str | None = None
    """Train on this configuration's stored traffic (a counterfactual replay) instead of collecting."""


@dataclass(frozen=True)
class Comparison:
    key: str
    claim: str
    kind: Literal["better", "no_worse", "less_variance"]
    """better: `a` beats `b`; no_worse: `a` is within NO_WORSE_FRACTION of `b`'s gain over the base
    of `b`, or better; less_variance: `a`'s final rate varies less over seeds than `b`'s."""
    a: str
    b: str


SC = {"type": "score_centering"}
CONFIGS: tuple[StudyConfig, ...] = (
    StudyConfig("sc16", {"estimator": SC}),
    StudyConfig("retok16", {"estimator": SC, "tokens": "retokenized"}, replay_of="sc16"),
    # one step per round: no lr warm-up (counted in global steps it would span 16 rounds)
    StudyConfig("sc1", {"estimator": SC, "steps": 1, "warmup_steps": 0}),
    StudyConfig(
        "retok1", {"estimator": SC, "steps": 1, "warmup_steps": 0, "tokens": "retokenized"}, replay_of="sc1"
    ),
    StudyConfig("reinforce", {"estimator": {"type": "reinforce"}}),
    StudyConfig("token_is", {"estimator": {"type": "token_is"}}),
    StudyConfig("tis_ppo", {"estimator": {"type": "tis_ppo"}}),
    StudyConfig("ref_is", {"estimator": {"type": "ref_is"}}),
    StudyConfig("sc_top_p", {"estimator": SC, "top_p": 0.95}),
    StudyConfig("sc_top_k", {"estimator": SC, "top_k": 20}),
    StudyConfig("tis_async", {"estimator": {"type": "tis_ppo"}, "schedule": "async1"}),
    StudyConfig("sc_async", {"estimator": SC, "schedule": "async1"}),
    StudyConfig("sc_async_kl", {"estimator": {**SC, "kl_beta": 0.1}, "schedule": "async1"}),
    StudyConfig("sc_qat", {"estimator": SC, "qat": True}),
)

COMPARISONS: tuple[Comparison, ...] = (
    Comparison(
        "a1", "recorded tokens learn better than retokenized traces (1 step/round)", "better", "sc1", "retok1"
    ),
    Comparison(
        "a16",
        "recorded tokens learn better than retokenized traces (16 steps/round)",
        "better",
        "sc16",
        "retok16",
    ),
    Comparison("b1", "score centering beats importance sampling (tis_ppo)", "better", "sc16", "tis_ppo"),
    Comparison("b2", "importance sampling beats reference-model IS", "better", "tis_ppo", "ref_is"),
    Comparison("b3", "score centering beats reinforce without correction", "better", "sc16", "reinforce"),
    Comparison("b4", "score centering beats token-level IS", "better", "sc16", "token_is"),
    Comparison("c1", "top-p 0.95 does not hurt score centering", "no_worse", "sc_top_p", "sc16"),
    Comparison("c2", "top-k 20 does not hurt score centering", "no_worse", "sc_top_k", "sc16"),
    Comparison(
        "d1", "one-round asynchrony: score centering beats tis_ppo", "better", "sc_async", "tis_async"
    ),
    Comparison(
        "d2", "one-round asynchrony costs score centering only a little", "no_worse", "sc_async", "sc16"
    ),
    Comparison(
        "e1",
        "a KL penalty lowers run-to-run variance (async score centering)",
        "less_variance",
        "sc_async_kl",
        "sc_async",
    ),
    Comparison("f1", "quantization-aware training does not hurt", "no_worse", "sc_qat", "sc16"),
)


def config(name: str) -> StudyConfig:
    by_name = {c.name: c for c in CONFIGS}
    if name not in by_name:
        raise KeyError(f"unknown study configuration {name!r}; known: {', '.join(by_name)}")
    return by_name[name]


def run_order(names: Sequence[str]) -> list[StudyConfig]:
    """The configurations to run, each replay after the configuration whose traffic it replays
    (which is added if missing)."""
    chosen = [config(n) for n in dict.fromkeys(names)]
    for c in list(chosen):
        if c.replay_of and config(c.replay_of) not in chosen:
            chosen.append(config(c.replay_of))
    return sorted(chosen, key=lambda c: c.replay_of is not None)


def store_name(c: StudyConfig) -> str:
    """The store (folder) a configuration's rounds live in: its own, or its traffic source's."""
    return c.replay_of or c.name


@dataclass(frozen=True)
class Difference:
    mean: float
    low: float
    high: float
    seeds: int


def seed_difference(per_seed: Sequence[float], single_seed_se: float | None = None) -> Difference:
    """Mean of per-seed differences with a 95% interval: Student's t over seeds, or, for one seed,
    the normal interval of its paired-puzzle standard error."""
    n = len(per_seed)
    if n == 0:
        raise ValueError("no seed has finished both configurations")
    mean = statistics.fmean(per_seed)
    if n == 1:
        half = 1.96 * (single_seed_se or 0.0)
    else:
        half = t975(n - 1) * statistics.stdev(per_seed) / math.sqrt(n)
    return Difference(mean, mean - half, mean + half, n)


def f_sf(f: float, d1: int, d2: int) -> float:
    """P(F >= f) for Snedecor's F with (d1, d2) degrees of freedom: the regularized incomplete
    beta I_x(d2/2, d1/2) at x = d2 / (d2 + d1 f)."""
    if f <= 0:
        return 1.0
    return _beta_inc(d2 / 2, d1 / 2, d2 / (d2 + d1 * f))


def _beta_inc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) by its continued fraction (modified Lentz)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast below the mean: use the symmetry
        return 1.0 - _beta_inc(b, a, 1 - x)
    front = (
        math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
        / a
    )
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-14:
            break
    return front * h


def variance_p(sd_a: float, sd_b: float, n: int) -> float:
    """One-sided F-test that A's variance over n seeds is smaller than B's: P(F >= s_b^2 / s_a^2)."""
    if sd_a == 0:
        return 0.0 if sd_b > 0 else 1.0
    return f_sf((sd_b / sd_a) ** 2, n - 1, n - 1)


def verdict(kind: str, diff: Difference | None = None, margin: float = 0.0, p: float | None = None) -> str:
    """reproduced / not reproduced / inconclusive for one comparison: `better` and `no_worse`
    from the interval of A - B (`no_worse` against -margin), `less_variance` from the F-test's
    one-sided p-value (and its mirror, p > 1 - alpha: A varies more)."""
    if kind == "less_variance":
        if p is None:
            return "inconclusive"
        return (
            "reproduced"
            if p < VARIANCE_ALPHA
            else "not reproduced"
            if p > 1 - VARIANCE_ALPHA
            else "inconclusive"
        )
    assert diff is not None
    floor = 0.0 if kind == "better" else -margin
    if diff.low > floor:
        return "reproduced"
    if diff.high < floor:
        return "not reproduced"
    return "inconclusive"
