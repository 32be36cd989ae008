"""The deploy gate: does a candidate deployment evaluate worse than the live one beyond a margin?

Both are scored on the same held-out puzzles, so the test is paired: d_i = solved_candidate_i -
solved_live_i, mean d, standard error s_d / sqrt(n). The gate fails when the evidence of a drop
larger than `margin` is significant at `confidence` (one-sided): d + z * SE < -margin. A
candidate that is merely noisy on a small eval set is not blocked; a clear regression is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


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


def deploy_gate(
    candidate: dict[str, bool], live: dict[str, bool], margin: float = 0.02, confidence: float = 0.95
) -> GateResult:
    """`candidate`, `live`: puzzle_id -> solved. Only puzzles scored for both count."""
    if not 0 < confidence < 1 or margin < 0:
        raise ValueError(f"need 0 < confidence < 1 and margin >= 0, got {confidence}, {margin}")
    shared = sorted(candidate.keys() & live.keys())
    if not shared:
        raise ValueError("the candidate and the live deployment share no evaluated puzzle")
    d = [float(candidate[p]) - float(live[p]) for p in shared]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    upper = mean + NormalDist().inv_cdf(confidence) * sd / math.sqrt(n)
    return GateResult(
        passed=upper >= -margin,
        n=n,
        candidate_rate=sum(candidate[p] for p in shared) / n,
        live_rate=sum(live[p] for p in shared) / n,
        diff=mean,
        upper_bound=upper,
        margin=margin,
    )
