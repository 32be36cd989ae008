"""The production gate: a canary of the candidate deployment on the traffic it would serve.

The gateway routes a share of new trajectories to the candidate and the rest to live (the
control arm; `gateway.deployments.candidate_arm`). Once both arms hold `min_per_arm` scored
trajectories, the gate compares their mean rewards once (a fixed-sample test: no repeated looks):
d = mean_c - mean_l, SE = sqrt(s_c^2 / n_c + s_l^2 / n_l) (Welch: unpaired, unequal variances; the
arms serve different trajectories), nu = SE^4 / ((s_c^2/n_c)^2/(n_c-1) + (s_l^2/n_l)^2/(n_l-1))
(Welch-Satterthwaite). Non-inferiority: the candidate is promoted when the one-sided lower
confidence bound d - t_{confidence, nu} * SE >= -margin, else rolled back. A canary that has not
reached `min_per_arm` on both arms after `max_wait_hours` is rolled back: live stays.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from scipy.stats import t as student_t

Decision = Literal["wait", "promote", "roll_back"]


@dataclass(frozen=True)
class CanaryConfig:
    """The production deploy gate (`lab.canary` in the settings file)."""

    type: Literal["canary", "off"] = "canary"
    """canary: a candidate goes live only once its canary passes. off: every candidate goes live
    unevaluated (a vLLM server swapped in place serves one deployment: it cannot run a canary)."""
    share: float = 0.25
    """Share of new trajectories routed to the candidate while its canary runs (stable per
    trajectory id); live serves the rest, the control arm."""
    margin: float = 0.05
    """Non-inferiority margin, in reward units: the candidate's mean reward may trail live's by
    this much."""
    confidence: float = 0.95
    """Confidence of the one-sided lower bound of mean_c - mean_l compared with -margin."""
    min_per_arm: int = 1000
    """Scored trajectories each arm needs before the test is run (once). With 0/1 rewards near 0.5,
    share 0.25 and the defaults, an equal candidate is promoted ~86% of the time and one 0.1 worse
    rolled back >99%."""
    max_wait_hours: float = 24.0
    """A canary still short of `min_per_arm` on either arm this long after it started is rolled
    back (live stays; every call it served stays recorded)."""

    def __post_init__(self) -> None:
        if not 0 < self.share < 1:  # NaN fails too
            raise ValueError(f"share must be in (0, 1): both arms need traffic; got {self.share}")
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0 (reward units), got {self.margin}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")
        if self.min_per_arm < 2:
            raise ValueError(
                f"min_per_arm must be >= 2 (a variance needs two rewards), got {self.min_per_arm}"
            )
        if not 0 < self.max_wait_hours < math.inf:
            raise ValueError(f"max_wait_hours must be > 0 and finite, got {self.max_wait_hours}")


@dataclass(frozen=True)
class WelchDifference:
    """mean_c - mean_l of two independent samples, its Welch standard error and degrees of freedom."""

    n_candidate: int
    n_control: int
    mean_candidate: float
    mean_control: float
    diff: float
    se: float
    df: float

    def lower_bound(self, confidence: float) -> float:
        """One-sided lower confidence bound d - t_{confidence, nu} * SE (d itself when SE = 0)."""
        return self.diff - (float(student_t.ppf(confidence, self.df)) * self.se if self.se > 0 else 0.0)

    def interval(self, confidence: float) -> tuple[float, float]:
        """Two-sided interval d -+ t_{(1+confidence)/2, nu} * SE."""
        half = float(student_t.ppf(0.5 + confidence / 2, self.df)) * self.se if self.se > 0 else 0.0
        return self.diff - half, self.diff + half


def _mean_var(x: list[float]) -> tuple[float, float]:
    """Mean and unbiased variance. Never raises: finite rewards too large to square (|r| ~ 1e154 and
    up, which the feedback endpoint accepts) give inf or nan, and `judge` rolls such a canary back."""
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.asarray(x, dtype=np.float64)
        return float(values.mean()), float(values.var(ddof=1))


def welch_difference(candidate: list[float], control: list[float]) -> WelchDifference:
    """Welch's unpaired difference of means (module docstring); each sample needs >= 2 values."""
    if len(candidate) < 2 or len(control) < 2:
        raise ValueError(f"each arm needs >= 2 rewards, got {len(candidate)} and {len(control)}")
    (m_c, v_c), (m_l, v_l) = _mean_var(candidate), _mean_var(control)
    a, b = v_c / len(candidate), v_l / len(control)
    se = math.sqrt(a + b)
    df = (a + b) ** 2 / (a**2 / (len(candidate) - 1) + b**2 / (len(control) - 1)) if se > 0 else math.inf
    return WelchDifference(len(candidate), len(control), m_c, m_l, m_c - m_l, se, df)


@dataclass(frozen=True)
class Verdict:
    """What the gate decided on the rewards it had, and why."""

    decision: Decision
    reason: str
    n_candidate: int
    n_control: int
    waited_hours: float
    difference: WelchDifference | None = None
    lower_bound: float | None = None

    def numbers(self) -> dict:
        """The measurements behind the decision (the gate check's metadata)."""
        out = {
            "decision": self.decision,
            "n_candidate": self.n_candidate,
            "n_control": self.n_control,
            "waited_hours": round(self.waited_hours, 4),
        }
        if self.difference is not None:
            d = self.difference
            out |= {k: v for k, v in asdict(d).items() if k.startswith(("mean_", "diff", "se", "df"))}
            out["lower_bound"] = self.lower_bound
        return out


def judge(
    config: CanaryConfig, candidate: list[float], control: list[float], waited_seconds: float
) -> Verdict:
    """The gate's rule on the arms' scored rewards `waited_seconds` after the canary started: wait
    until both arms hold `min_per_arm`, then test once (promote iff the lower bound >= -margin);
    past `max_wait_hours` short of the sample, roll back."""
    n_c, n_l, hours = len(candidate), len(control), waited_seconds / 3600
    short = min(n_c, n_l) < config.min_per_arm
    if short:
        sample = f"{n_c} candidate / {n_l} control scored trajectories of {config.min_per_arm} per arm"
        if hours < config.max_wait_hours:
            return Verdict("wait", f"waiting: {sample}", n_c, n_l, hours)
        return Verdict(
            "roll_back",
            f"rolled back: {sample} after {hours:.2f} h (max_wait_hours {config.max_wait_hours:g})",
            n_c,
            n_l,
            hours,
        )
    d = welch_difference(candidate, control)
    bound = d.lower_bound(config.confidence)
    if not math.isfinite(bound):
        return Verdict(
            "roll_back",
            f"rolled back: the rewards' statistics are not finite (mean candidate {d.mean_candidate:g}, "
            f"live {d.mean_control:g}, SE {d.se:g}): a reward too large to test",
            n_c,
            n_l,
            hours,
            d,
            bound,
        )
    promote = bound >= -config.margin
    verb = "promoted" if promote else "rolled back"
    reason = (
        f"{verb}: candidate {d.mean_candidate:.4f} (n={n_c}) vs live {d.mean_control:.4f} (n={n_l}); "
        f"diff {d.diff:+.4f}, {config.confidence:.0%} lower bound {bound:+.4f} "
        f"{'>=' if promote else '<'} -margin {-config.margin:+.4f}"
    )
    return Verdict("promote" if promote else "roll_back", reason, n_c, n_l, hours, d, bound)
