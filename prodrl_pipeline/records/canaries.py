"""The canaries registry: the production gate's canaries, one row each (docs/operations.md, "The
production gate").

The `deployment` asset opens a canary of its candidate against the live deployment (the control);
the gateway routes a share of new trajectories to the candidate while a canary is active; the
`canary_gate` check closes it, promoting the candidate (the live pointer moves, compare-and-set) or
rolling it back (live stays). At most one canary is active: the oldest undecided one; a later one
(async1: round k's candidate while round k-1's canary runs) starts when it is decided, against the
deployment live then (its control moves with live).

A decision is claimed before it acts: the open row is replaced by the decided one in one
compare-and-set (`DeltaStore.replace_if` on status 'open'), so of two decisions (a rule run and an
operator's override) exactly one applies. A promotion is claimed as 'promoting', then moves live,
then is recorded 'promoted' (or 'rolled_back' when live had moved elsewhere); a run that dies in
between leaves it 'promoting', and the next `canary_job` run finishes it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from datetime import UTC, datetime

from prodrl_pipeline.evals.canary import CanaryConfig, Verdict, judge
from prodrl_pipeline.records.queries import run_sql
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rounds import goes_live

log = logging.getLogger(__name__)

OPEN, PROMOTING, PROMOTED, ROLLED_BACK = "open", "promoting", "promoted", "rolled_back"
UNDECIDED = (OPEN, PROMOTING)
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
    """The active canary (the oldest undecided one) and when it started: when it opened, or when the
    last canary opened before it was decided, whichever is later (it waited for that one)."""
    open_ = [r for r in rows if r["status"] in UNDECIDED]
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
        settle(store, previous, False, "deployment", "superseded: the candidate was exported again", {})
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


class AlreadyDecided(RuntimeError):
    """Another decision claimed the canary first."""


def close(store: DeltaStore, row: dict, status: str, decided_by: str, reason: str, verdict: dict) -> dict:
    """Claim the canary `row` for a decision: its stored row, if still open, becomes `status` with
    who decided, why and the rule's numbers (no live move: `settle` does that). Returns the decided
    row; raises AlreadyDecided, naming the decision that won, if it was no longer open."""
    decided = {
        **row,
        "status": status,
        "decided_at": datetime.now(UTC),
        "decided_by": decided_by,
        "reason": reason,
        "verdict_json": json.dumps(verdict),
    }
    if not store.replace_if("canaries", decided, "canary_id", f"t.status = '{OPEN}'"):
        now = [r for r in canaries(store) if r["canary_id"] == row["canary_id"]]
        won = f"{now[0]['status']} by {now[0]['decided_by']} ({now[0]['reason']})" if now else "gone"
        raise AlreadyDecided(f"canary {row['canary_id']} was decided already: {won}")
    return decided


def settle(store: DeltaStore, row: dict, promote: bool, decided_by: str, reason: str, verdict: dict) -> dict:
    """Decide the open canary `row` (claimed first: `close`): roll it back (live stays), or promote
    it (`finish`). The next canary then starts against the live deployment. Returns the closed row."""
    decided = close(store, row, PROMOTING if promote else ROLLED_BACK, decided_by, reason, verdict)
    return finish(store, decided) if promote else _started_next(store, decided)


def finish(store: DeltaStore, row: dict) -> dict:
    """Finish the claimed promotion `row` ('promoting'): move live to the candidate if live is still
    the control (or already the candidate: a move made before a run died), forward only
    (`rounds.goes_live`); record it 'promoted', or 'rolled_back' saying where live is."""
    allowed = lambda now: goes_live(  # noqa: E731
        gate_passed=True,
        counterfactual=False,
        round_=row["round"],
        candidate=row["deployment_id"],
        gated_against=row["control_id"],
        live=now,
    )
    finished = {**row, "status": PROMOTED}
    if not store.move_live(row["deployment_id"], allowed):
        live = (store.live_deployment() or {}).get("deployment_id")
        reason = f"{row['reason']}; not promoted: live is {live}, no longer {row['control_id']}"
        finished = {**row, "status": ROLLED_BACK, "reason": reason}
    if not store.replace_if("canaries", finished, "canary_id", f"t.status = '{PROMOTING}'"):
        raise AlreadyDecided(f"canary {row['canary_id']} was finished by another run")
    return _started_next(store, finished)


def _started_next(store: DeltaStore, closed: dict) -> dict:
    """After `closed` was decided: the next canary (now active) is judged against the deployment
    live now, which its queued row may not name (async1: it opened while `closed` ran, against the
    live of then); its control moves, compare-and-set. Returns `closed`."""
    found = active(canaries(store))
    live = (store.live_deployment() or {}).get("deployment_id")
    if found and found[0]["status"] == OPEN and live and found[0]["control_id"] != live:
        nxt = found[0]
        condition = f"t.status = '{OPEN}' AND t.control_id = '{nxt['control_id']}'"
        if store.replace_if("canaries", {**nxt, "control_id": live}, "canary_id", condition):
            log.info(
                "canary %s starts against %s (opened against %s)", nxt["canary_id"], live, nxt["control_id"]
            )
    return closed
