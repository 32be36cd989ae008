"""The production source of a round: a snapshot of the gateway's landing tables.

The snapshot reads `landing_calls` and `landing_feedback` each at one pinned Delta version (the
latest, or the versions a previous snapshot of the round pinned), so replaying a round reads
exactly the same rows. It returns the round's calls and trajectory rows in the per-round schema.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from prodrl_pipeline.records.queries import SQL_DIR
from prodrl_pipeline.records.store import SAFE_ID, DeltaStore

LANDING = ("landing_calls", "landing_feedback")


def _latest_versions(store: DeltaStore) -> dict[str, int]:
    """The landing tables' latest versions, feedback pinned first: the landing log commits a
    segment's calls before its feedback, so every call of a trajectory whose reward is visible at
    the pinned feedback version is visible at the (later) pinned calls version."""
    feedback = store.table("landing_feedback").version()
    return {"landing_calls": store.table("landing_calls").version(), "landing_feedback": feedback}


@dataclass
class Snapshot:
    calls: list[dict]
    trajectories: list[dict]
    versions: dict[str, int]  # landing table -> pinned Delta version


def _snapshot_query(store: DeltaStore, round_: int, deployment_id: str, limit: int) -> str:
    if not SAFE_ID.fullmatch(deployment_id):
        raise ValueError(f"deployment id {deployment_id!r} must match {SAFE_ID.pattern}")
    if not store.exists("trajectories"):
        store.append("trajectories", [])  # an empty table, so the SQL can exclude taken ids
    return (
        (SQL_DIR / "production_snapshot.sql")
        .read_text()
        .format(deployment_id=deployment_id, round=int(round_), limit=int(limit))
    )


def _run(store: DeltaStore, sql: str, versions: dict[str, int]) -> pa.Table:
    return store.query(sql, [*LANDING, "trajectories"], versions)


def count_available(
    store: DeltaStore, round_: int, deployment_id: str, limit: int
) -> tuple[int, dict[str, int]]:
    """How many trajectories (capped at `limit`) a production round could take now, and the landing
    versions counted: a version-bounded query over the landing tables' id, deployment and reward
    columns, cheap enough for a sensor tick. (0, {}) before any traffic has landed."""
    if not all(store.exists(t) for t in LANDING):
        return 0, {}
    versions = _latest_versions(store)
    sql = f"SELECT count(*) AS n FROM ({_snapshot_query(store, round_, deployment_id, limit)}) s"
    return _run(store, sql, versions).column("n")[0].as_py(), versions


def snapshot_production(
    store: DeltaStore, round_: int, deployment_id: str, limit: int, versions: dict[str, int] | None = None
) -> Snapshot:
    """Up to `limit` scored trajectories served by `deployment_id`, as round `round_`'s rows."""
    missing = [t for t in LANDING if not store.exists(t)]
    if missing:
        raise RuntimeError(
            f"no production traffic yet: {missing} missing under {store.root}; is the gateway recording?"
        )
    versions = versions or _latest_versions(store)
    rows = _run(store, _snapshot_query(store, round_, deployment_id, limit), versions).to_pylist()
    chosen = {r["trajectory_id"] for r in rows}
    calls = [
        {**c, "round": round_}
        for c in store.read("landing_calls", version=versions["landing_calls"]).to_pylist()
        if c["trajectory_id"] in chosen
    ]
    trajectories = [{**r, "round": round_, "task_id": None, "source": "production"} for r in rows]
    return Snapshot(calls, trajectories, versions)
