"""The canaries registry: the production gate's canaries, one row each (docs/operations.md, "The
production gate").

The `deployment` asset opens a canary of its candidate against the live deployment (the control);
the gateway routes a share of new trajectories to the candidate while a canary is active; the
`canary_gate` check closes it, promoting the candidate (the live pointer moves, compare-and-set) or
rolling it back (live stays). At most one canary is active: the oldest undecided one; a later one
(async1: round k's candidate while round k-1's canary runs) starts when it is decided. The active
canary is judged against the deployment live now: `sync`, run before every judgement and after
every decision, moves its control with live (or closes it if its candidate can no longer go live).

A decision is claimed before it acts: the open row's decision columns are set in one
compare-and-set (`DeltaStore.update_if` on status 'open'), so of two decisions (a rule run and an
operator's override) exactly one applies. A promotion is claimed as 'promoting', then moves live,
then is recorded 'promoted' (or 'rolled_back' when live had moved elsewhere); a run that dies in
between leaves it 'promoting', and the next `canary_job` run finishes it. A candidate exported
again has its open canary rolled back first (`supersede`), and is refused while one is promoting.
"""

from __future__ import annotations

import json
import logging
from contextlib import suppress
from dataclasses import asdict
from datetime import UTC, datetime

from prodrl_pipeline.evals.canary import CanaryConfig, Verdict, judge
from prodrl_pipeline.records.queries import run_sql
from prodrl_pipeline.records.registry import live_deployment, move_live
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
    """The canary of the candidate `deployment_id` a decision acts on: the one being promoted, else
    the newest (a re-export opens another)."""
    mine = [r for r in rows if r["deployment_id"] == deployment_id]
    promoting = [r for r in mine if r["status"] == PROMOTING]
    return (promoting or mine or [None])[-1]


def active(rows: list[dict]) -> tuple[dict, datetime] | None:
    """The active canary (the oldest undecided one) and when it started: when it opened, or when the
    last canary opened before it was decided, whichever is later (it waited for that one)."""
    open_ = [r for r in rows if r["status"] in UNDECIDED]
    if not open_:
        return None
    first = open_[0]
    earlier = [r["decided_at"] for r in rows if r["opened_at"] < first["opened_at"] and r["decided_at"]]
    return first, max([first["opened_at"], *earlier])


class CanaryBusy(RuntimeError):
    """The candidate's canary is being promoted: it cannot be exported again until that finishes."""


def supersede(store: DeltaStore, deployment_id: str) -> None:
    """Before the candidate `deployment_id` is exported again (its round re-run): roll back its open
    canary (the new export gets its own); refuse, raising CanaryBusy, while one is being promoted."""
    if not store.exists("canaries"):
        return
    for row in canaries(store):
        if row["deployment_id"] != deployment_id or row["status"] not in UNDECIDED:
            continue
        try:
            if row["status"] == OPEN:
                close(
                    store, row, ROLLED_BACK, "deployment", "superseded: the candidate was exported again", {}
                )
                continue
        except AlreadyDecided:
            row = _row(store, row["canary_id"])
            if row["status"] != PROMOTING:
                continue
        raise CanaryBusy(
            f"canary {row['canary_id']} of {deployment_id} is being promoted ({row['reason']}); export it "
            "again once canary_job has finished it"
        )
    sync(store)


def open_canary(
    store: DeltaStore, *, deployment_id: str, round_: int, control_id: str, config: CanaryConfig
) -> dict:
    """Open a canary of `deployment_id` against the live `control_id` (`supersede` first if the
    candidate had one)."""
    rows = canaries(store)
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
    sync(store)  # live may have moved since `control_id` was read
    return _row(store, row["canary_id"])


def _row(store: DeltaStore, canary_id: str) -> dict:
    return next(r for r in canaries(store) if r["canary_id"] == canary_id)


def sync(store: DeltaStore) -> list[dict]:
    """Keep the active canary judged against live; idempotent. An open active canary whose control
    is no longer live gets live as its control (compare-and-set) if its candidate could still go
    live against it (`rounds.goes_live`: live only moves forward); otherwise it is closed, rolled
    back, saying why. Returns the registry's rows after."""
    rows = canaries(store)
    found = active(rows)
    live_row = live_deployment(store)
    if found is None or found[0]["status"] != OPEN or live_row is None:
        return rows
    row, live = found[0], live_row["deployment_id"]
    if row["control_id"] == live:
        return rows
    movable = row["deployment_id"] != live and goes_live(
        gate_passed=True,
        counterfactual=False,
        round_=row["round"],
        candidate=row["deployment_id"],
        gated_against=live,
        live=live_row,
    )
    if movable:
        condition = f"t.status = '{OPEN}' AND t.control_id = '{row['control_id']}'"
        if store.update_if("canaries", {**row, "control_id": live}, "canary_id", ["control_id"], condition):
            log.info("canary %s: its control is %s now (was %s)", row["canary_id"], live, row["control_id"])
    else:
        why = (
            "its candidate is live already"
            if row["deployment_id"] == live
            else f"live is {live} (round {live_row['round']}), and live only moves forward"
        )
        with suppress(AlreadyDecided):  # another decision closed it first
            close(store, row, ROLLED_BACK, BY_RULE, f"not judged: {why}", {})
            log.warning("canary %s closed, not judged: %s", row["canary_id"], why)
    return sync(store)


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


DECISION_COLUMNS = ("status", "decided_at", "decided_by", "reason", "verdict_json")


def close(store: DeltaStore, row: dict, status: str, decided_by: str, reason: str, verdict: dict) -> dict:
    """Claim the canary `row` for a decision: if its stored row is still open, set its decision
    columns to `status`, who decided, why and the rule's numbers (no live move: `settle` does that).
    Returns the stored row after; raises AlreadyDecided, naming the decision that won, if it was no
    longer open."""
    decided = {
        **row,
        "status": status,
        "decided_at": datetime.now(UTC),
        "decided_by": decided_by,
        "reason": reason,
        "verdict_json": json.dumps(verdict),
    }
    condition = f"t.status = '{OPEN}' AND t.control_id = '{row['control_id']}'"  # as it was judged
    if not store.update_if("canaries", decided, "canary_id", DECISION_COLUMNS, condition):
        now = _row(store, row["canary_id"])
        if now["status"] == OPEN:
            raise AlreadyDecided(
                f"canary {row['canary_id']}'s control moved to {now['control_id']} (live moved) since it "
                f"was judged against {row['control_id']}: judge it again"
            )
        raise AlreadyDecided(
            f"canary {row['canary_id']} was decided already: {now['status']} by {now['decided_by']} "
            f"({now['reason']})"
        )
    return _row(store, row["canary_id"])


def settle(store: DeltaStore, row: dict, promote: bool, decided_by: str, reason: str, verdict: dict) -> dict:
    """Decide the open canary `row` (claimed first: `close`): roll it back (live stays), or promote
    it (`finish`); then `sync` starts the next one against live. Returns the closed row."""
    decided = close(store, row, PROMOTING if promote else ROLLED_BACK, decided_by, reason, verdict)
    if promote:
        return finish(store, decided)
    _sync_after(store)
    return decided


def _sync_after(store: DeltaStore) -> None:
    """`sync` after a decision, which stands whatever happens here: a failure is logged (the next
    judgement's `sync` repeats it)."""
    try:
        sync(store)
    except Exception:  # noqa: BLE001
        log.exception("starting the next canary after a decision failed; the next sensor tick retries it")


def finish(store: DeltaStore, row: dict) -> dict:
    """Finish the claimed promotion `row` ('promoting'): move live to the candidate if live is still
    the control (or already the candidate: a move made before a run died), forward only
    (`rounds.goes_live`); record it 'promoted', or 'rolled_back' saying where live is; then `sync`."""
    allowed = lambda now: goes_live(  # noqa: E731
        gate_passed=True,
        counterfactual=False,
        round_=row["round"],
        candidate=row["deployment_id"],
        gated_against=row["control_id"],
        live=now,
    )
    finished = {**row, "status": PROMOTED}
    if not move_live(store, row["deployment_id"], allowed):
        live = (live_deployment(store) or {}).get("deployment_id")
        reason = f"{row['reason']}; not promoted: live is {live}, no longer {row['control_id']}"
        finished = {**row, "status": ROLLED_BACK, "reason": reason}
    if not store.update_if(
        "canaries", finished, "canary_id", ["status", "reason"], f"t.status = '{PROMOTING}'"
    ):
        raise AlreadyDecided(f"canary {row['canary_id']} was finished by another run")
    _sync_after(store)
    return _row(store, row["canary_id"])
