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
POWER = 0.80
"""The power at which each comparison's minimum detectable difference (MDE) is stated."""
PILOT_SD = 0.0043
"""Planning value of the sd over seeds of one final-round difference A - B: the root mean square of
the 10 non-zero comparisons' seed sds in the 3-round, 3-seed study this design replaced (each sd
recovered from its 95% interval's half-width h as h sqrt(3) / t_.975(2))."""
STUDY_DEFAULTS: Mapping[str, object] = {"gate_margin": 1.0}
"""Lab settings every configuration shares. The deploy gate is opened: a configuration that
regresses must still deploy and be measured (a held-back deployment would change its traffic)."""


def _bisect(cdf, q: float, high: float) -> float:  # noqa: ANN001
    """x >= 0 with cdf(x) = q for an increasing cdf, to 1e-10 relative."""
    low = 0.0
    while cdf(high) < q:
        low, high = high, 2 * high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < q else (low, mid)
        if high - low <= 1e-10 * high:
            break
    return (low + high) / 2


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile for q in [0.5, 1): P(T <= t) = 1 - I_x(df/2, 1/2) / 2, x = df / (df + t^2)."""
    if not 0.5 <= q < 1:
        raise ValueError(f"q must be in [0.5, 1), got {q}")
    return _bisect(lambda t: 1 - _beta_inc(df / 2, 0.5, df / (df + t * t)) / 2, q, 1.0)


def t975(df: int) -> float:
    return t_quantile(0.975, df)


def f_quantile(q: float, d1: int, d2: int) -> float:
    """Snedecor's F quantile: P(F <= f) = q."""
    return _bisect(lambda f: 1 - f_sf(f, d1, d2), q, 1.0)


def mde(kind: str, seeds: int, sd: float = PILOT_SD, single_seed_se: float | None = None) -> float:
    """The smallest true effect a comparison detects with probability POWER. `better` / `no_worse`
    (a difference; from the margin for no_worse): (t_.975(n-1) + t_POWER(n-1)) sd / sqrt(n) over
    n >= 2 seeds, sd that of the per-seed differences; (z_.975 + z_POWER) se with one seed.
    `less_variance`: the ratio sd_B / sd_A = sqrt(F_.95(d, d) F_POWER(d, d)), d = n - 1, at which
    the one-sided F-test at VARIANCE_ALPHA rejects with probability POWER (inf below 3 seeds)."""
    if kind == "less_variance":
        if seeds < 3:
            return math.inf
        d = seeds - 1
        return math.sqrt(f_quantile(1 - VARIANCE_ALPHA, d, d) * f_quantile(POWER, d, d))
    if seeds == 1:
        z975, z_power = 1.959964, 0.841621
        return (z975 + z_power) * (single_seed_se if single_seed_se is not None else sd)
    return (t975(seeds - 1) + t_quantile(POWER, seeds - 1)) * sd / math.sqrt(seeds)


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
    if diff.high < floor or (kind == "better" and diff.low == diff.high == floor):
        return "not reproduced"  # (or A and B gave the same result in every seed)
    return "inconclusive"
