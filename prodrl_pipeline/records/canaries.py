"""The canaries registry: the production gate's canaries, one row each (docs/operations.md, "The
production gate").

The `deployment` asset opens a canary of its candidate against the live deployment (the control);
the gateway routes a share of new trajectories to the candidate while a canary is active; the
`canary_gate` check closes it, promoting the candidate (the live pointer moves, compare-and-set) or
rolling it back (live stays). At most one canary is active: the oldest open one; a later one
(async1: round k's candidate while round k-1's canary runs) starts when it is decided.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime

from prodrl_pipeline.evals.canary import CanaryConfig, Verdict, judge
from prodrl_pipeline.records.queries import run_sql
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rounds import goes_live

OPEN, PROMOTED, ROLLED_BACK = "open", "promoted", "rolled_back"
BY_RULE = "rule"
"""`decided_by` of a decision the gate's rule made (else the operator who overrode it)."""
ARMS = ("candidate", "control")


def canaries(store: DeltaStore) -> list[dict]:
    """Every canary, oldest first."""
    return sorted(store.read("canaries").to_pylist(), key=lambda r: (r["opened_at"], r["canary_id"]))


def of_round(rows: list[dict], deployment_id: str) -> dict | None:
    """The newest canary of the candidate `deployment_id` (a re-export opens another)."""
    mine = [r for r in rows if r["deployment_id"] == deployment_id]
    return mine[-1] if mine else None


def active(rows: list[dict]) -> tuple[dict, datetime] | None:
    """The active canary (the oldest open one) and when it started: when it opened, or when the
    last canary opened before it was decided, whichever is later (it waited for that one)."""
    open_ = [r for r in rows if r["status"] == OPEN]
    if not open_:
        return None
    first = open_[0]
    earlier = [r["decided_at"] for r in rows if r["opened_at"] < first["opened_at"] and r["decided_at"]]
    return first, max([first["opened_at"], *earlier])


def open_canary(
    store: DeltaStore, *, deployment_id: str, round_: int, control_id: str, config: CanaryConfig
) -> dict:
    """Open a canary of `deployment_id` against the live `control_id`. An open canary of the same
    candidate (an earlier export of it: its round was re-run) is rolled back first."""
    rows = canaries(store)
    if (previous := of_round(rows, deployment_id)) is not None and previous["status"] == OPEN:
        close(store, previous, ROLLED_BACK, "deployment", "superseded: the candidate was exported again", {})
    n = sum(r["deployment_id"] == deployment_id for r in rows) + 1
    row = {
        "canary_id": f"{deployment_id}.{n}",
        "deployment_id": deployment_id,
        "round": round_,
        "control_id": control_id,
        "share": config.share,
        "config_json": json.dumps(asdict(config)),
        "opened_at": datetime.now(UTC),
        "status": OPEN,
        "decided_at": None,
        "decided_by": None,
        "reason": None,
        "verdict_json": None,
    }
    store.overwrite("canaries", [row], f"canary_id = '{row['canary_id']}'")
    return row


def config_of(row: dict) -> CanaryConfig:
    """The gate settings the canary was opened with."""
    return CanaryConfig(**json.loads(row["config_json"]))


def arm_rewards(store: DeltaStore, row: dict) -> tuple[dict[str, list[float]], dict[str, int]]:
    """The rewards of the scored trajectories the canary routed, by arm (`sql/canary_arms.sql`; a
    trajectory counts when its one deployment is its arm's), and the landing versions read."""
    rewards: dict[str, list[float]] = {arm: [] for arm in ARMS}
    if not all(store.exists(t) for t in ("landing_calls", "landing_feedback")):
        return rewards, {}
    feedback = store.table("landing_feedback").version()  # first: a call precedes its reward
    calls = store.table("landing_calls")
    versions = {"landing_calls": calls.version(), "landing_feedback": feedback}
    if "canary_id" not in calls.schema().to_arrow().names:  # written before canaries existed
        return rewards, versions
    served_by = {"candidate": row["deployment_id"], "control": row["control_id"]}
    found = run_sql(store, "canary_arms", list(versions), versions, canary_id=row["canary_id"])
    for r in found.to_pylist():
        if served_by.get(r["arm"]) == r["deployment_id"]:
            rewards[r["arm"]].append(r["reward"])
    return rewards, versions


def evaluate(store: DeltaStore, rows: list[dict], row: dict, now: datetime) -> tuple[Verdict, dict[str, int]]:
    """The gate's rule (`evals.canary.judge`, with the settings the canary opened with) on canary
    `row` of the registry `rows` at `now`: its arms' rewards and the time since it started (a
    queued canary has not started: 0 s); and the landing versions read."""
    found = active(rows)
    started = found[1] if found and found[0]["canary_id"] == row["canary_id"] else now
    rewards, versions = arm_rewards(store, row)
    waited = (now - started).total_seconds()
    return judge(config_of(row), rewards["candidate"], rewards["control"], waited), versions


def close(store: DeltaStore, row: dict, status: str, decided_by: str, reason: str, verdict: dict) -> dict:
    """Record the canary's decision (no live move: `settle` does that)."""
    closed = {
        **row,
        "status": status,
        "decided_at": datetime.now(UTC),
        "decided_by": decided_by,
        "reason": reason,
        "verdict_json": json.dumps(verdict),
    }
    store.overwrite("canaries", [closed], f"canary_id = '{row['canary_id']}'")
    return closed


def settle(store: DeltaStore, row: dict, promote: bool, decided_by: str, reason: str, verdict: dict) -> dict:
    """Close the open canary `row`: promote moves live to the candidate, if live is still the
    control (or already the candidate: a decision recorded after its move), and live moves forward
    only (`rounds.goes_live`); otherwise, or to roll back, live stays. Returns the closed row."""
    if promote:
        allowed = lambda now: goes_live(  # noqa: E731
            gate_passed=True,
            counterfactual=False,
            round_=row["round"],
            candidate=row["deployment_id"],
            gated_against=row["control_id"],
            live=now,
        )
        if not store.move_live(row["deployment_id"], allowed):
            live = (store.live_deployment() or {}).get("deployment_id")
            reason += f"; not promoted: live is {live}, no longer {row['control_id']}"
            promote = False
    return close(store, row, PROMOTED if promote else ROLLED_BACK, decided_by, reason, verdict)
