"""The logic of the round's asset checks, as pure functions of tables or rows: (passed, metadata)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import pyarrow as pa

from prodrl_pipeline.records.screen import sound_calls
from prodrl_pipeline.records.validate import call_problem

SUSTAINED_ROUNDS = 3  # a rise over this many consecutive rounds is "sustained"


def token_integrity(calls: pa.Table, trajectories: pa.Table) -> tuple[bool, dict]:
    """Every call keeps the data contract (lengths, id range, finite non-positive log-probs,
    support); every trajectory is scored and has exactly its calls. Columnar: the calls are
    screened over whole columns (records/screen.py); only a call the screen flags is read as a
    dict, for `call_problem` to name the rule it breaks."""
    flagged = calls.filter(pa.array(~sound_calls(calls)))
    problems = [f"{c['call_id']}: {p}" for c in flagged.to_pylist() if (p := call_problem(c))]
    n_calls = Counter(calls.column("trajectory_id").to_pylist())
    ids = trajectories.column("trajectory_id").to_pylist()
    reward = trajectories.column("reward").to_numpy(zero_copy_only=False).astype(float)  # null: nan
    recorded = trajectories.column("n_calls").to_pylist()
    miscounted = sum(n_calls[t] != n for t, n in zip(ids, recorded, strict=True))
    orphans = set(n_calls) - set(ids)
    unscored = int((~np.isfinite(reward)).sum())
    passed = bool(ids) and not (problems or unscored or miscounted or orphans)
    return passed, {
        "calls": len(calls),
        "trajectories": len(ids),
        "contract_violations": len(problems),
        "first_violations": "\n".join(problems[:5]),
        "unscored": unscored,
        "n_calls_mismatch": miscounted,
        "calls_without_trajectory": len(orphans),
    }


def advantage_sanity(rows: list[dict], trajectory_ids: set[str]) -> tuple[bool, dict]:
    """Finite advantages, one per known trajectory, summing to zero in each minibatch (the
    batch-mean baseline makes sum_i A_i = 0 exactly, up to float error)."""
    ids = [r["trajectory_id"] for r in rows]
    sums: dict[int, float] = defaultdict(float)
    for r in rows:
        sums[r["minibatch"]] += r["advantage"]
    nonfinite = sum(not math.isfinite(r["advantage"]) for r in rows)
    off = max((abs(v) for v in sums.values()), default=0.0)
    passed = (
        bool(rows)
        and not nonfinite
        and len(ids) == len(set(ids))
        and set(ids) <= trajectory_ids
        and off < 1e-6
    )
    return passed, {
        "rows": len(rows),
        "nonfinite": nonfinite,
        "duplicates": len(ids) - len(set(ids)),
        "unknown_trajectories": len(set(ids) - trajectory_ids),
        "max_abs_minibatch_sum": off,
        "minibatches": len(sums),
    }


def mismatch_monitor(
    steps: list[dict], round_: int, mismatch_warn: float, staleness_warn: float
) -> tuple[bool, bool, dict]:
    """(passed, sustained, metadata) from `train_steps` rows of one experiment. Not passed when round
    `round_`'s mean engine mismatch or staleness is above its threshold; `sustained` when the engine
    mismatch also rose over the last SUSTAINED_ROUNDS rounds: the early warning of a collapse."""
    per_round: dict[int, list[dict]] = defaultdict(list)
    for r in steps:
        if r["round"] <= round_:
            per_round[r["round"]].append(r)
    if round_ not in per_round:
        return False, False, {"reason": f"no train_steps for round {round_}"}
    mean = {
        k: {m: sum(r[m] for r in rs) / len(rs) for m in ("engine_mismatch", "staleness")}
        for k, rs in per_round.items()
    }
    recent = [mean[k]["engine_mismatch"] for k in sorted(mean)[-(SUSTAINED_ROUNDS + 1) :]]
    rising = len(recent) == SUSTAINED_ROUNDS + 1 and all(
        b > a for a, b in zip(recent, recent[1:], strict=False)
    )
    high = mean[round_]["engine_mismatch"] > mismatch_warn or mean[round_]["staleness"] > staleness_warn
    sustained = rising and recent[-1] > mismatch_warn
    return (
        not high,
        sustained,
        {
            "engine_mismatch": mean[round_]["engine_mismatch"],
            "staleness": mean[round_]["staleness"],
            "mismatch_warn": mismatch_warn,
            "staleness_warn": staleness_warn,
            "recent_engine_mismatch": str([round(x, 5) for x in recent]),
            "sustained_rise": sustained,
        },
    )
