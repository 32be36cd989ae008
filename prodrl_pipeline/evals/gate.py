"""The lab's deploy gate: does a candidate deployment evaluate worse than the live one beyond a
margin? (Production gates on live traffic instead: `evals/canary.py`.)

Both are scored on the same held-out puzzles, so the test is paired: d_i = solved_candidate_i -
solved_live_i, mean d, standard error s_d / sqrt(n). The gate fails when the evidence of a drop
larger than `margin` is significant at `confidence` (one-sided): d + z * SE < -margin. A
candidate that is merely noisy on a small eval set is not blocked; a clear regression is. The
same paired statistics give the two-sided interval of a run's gain over its base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

NO_GATE = "production gate off (canary type off): the candidate is deployed without evaluation"
"""The deploy gate's verdict in production mode with the canary off: it passes, judging nothing."""
NO_EVALUATION = "none offline in production mode: the lab's held-out puzzles are not a deployment's task"
"""What production mode reports where the lab reports held-out solve rates (its candidates are
judged by their canary on live traffic, `evals/canary.py`)."""


@dataclass(frozen=True)
class GateResult:
    passed: bool
    n: int
    candidate_rate: float
    live_rate: float
    diff: float  # mean paired difference candidate - live
    upper_bound: float  # one-sided upper confidence bound of the difference
    margin: float

    def reason(self) -> str:
        verdict = "passes" if self.passed else "FAILS"
        return (
            f"gate {verdict}: candidate {self.candidate_rate:.3f} vs live {self.live_rate:.3f} "
            f"on {self.n} paired puzzles; diff {self.diff:+.3f}, "
            f"upper bound {self.upper_bound:+.3f} vs -margin {-self.margin:+.3f}"
        )


@dataclass(frozen=True)
class PairedDifference:
    """Mean paired difference of two deployments' solve rates on the same puzzles."""

    n: int
    rate: float  # the first deployment's solve rate on the shared puzzles
    baseline_rate: float
    diff: float  # mean of d_i = solved_i - baseline_solved_i
    se: float  # s_d / sqrt(n)

    def interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """Two-sided normal-approximation confidence interval of the difference."""
        z = NormalDist().inv_cdf(0.5 + confidence / 2)
        return self.diff - z * self.se, self.diff + z * self.se


def paired_difference(solved: dict[str, bool], baseline: dict[str, bool]) -> PairedDifference:
    """`solved`, `baseline`: puzzle_id -> solved. Only puzzles scored for both count."""
    shared = sorted(solved.keys() & baseline.keys())
    if not shared:
        raise ValueError("the two deployments share no evaluated puzzle")
    d = [float(solved[p]) - float(baseline[p]) for p in shared]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    return PairedDifference(
        n=n,
        rate=sum(solved[p] for p in shared) / n,
        baseline_rate=sum(baseline[p] for p in shared) / n,
        diff=mean,
        se=sd / math.sqrt(n),
    )


def check_gate_settings(margin: float, confidence: float) -> None:
    """ValueError unless 0 < confidence < 1 and margin >= 0 (NaN fails both)."""
    if not 0 < confidence < 1 or not margin >= 0:
        raise ValueError(f"need 0 < confidence < 1 and margin >= 0, got {confidence}, {margin}")


def deploy_gate(
    candidate: dict[str, bool], live: dict[str, bool], margin: float = 0.02, confidence: float = 0.95
) -> GateResult:
    """`candidate`, `live`: puzzle_id -> solved. Only puzzles scored for both count."""
    check_gate_settings(margin, confidence)
    p = paired_difference(candidate, live)
    upper = p.diff + NormalDist().inv_cdf(confidence) * p.se
    return GateResult(
        passed=upper >= -margin,
        n=p.n,
        candidate_rate=p.rate,
        live_rate=p.baseline_rate,
        diff=p.diff,
        upper_bound=upper,
        margin=margin,
    )
