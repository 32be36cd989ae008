"""Cross-round lineage as data (docs/operations.md): the checkpoint registry (with parent pointers) and
the deployments registry, with its explicit `live` pointer, moved by a compare-and-set (the base
model, a round's deploy gate, a canary's promotion, the gateway's own base)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import UTC, datetime

from deltalake.exceptions import CommitFailedError

from prodrl_pipeline.records.store import SAFE_ID, DeltaStore

BASE = "base"


def round_id(experiment: str, round_: int) -> str:
    """The id of the checkpoint (and of its deployment) that round `round_` of `experiment` makes."""
    if not SAFE_ID.fullmatch(experiment):
        raise ValueError(f"experiment name {experiment!r} must match {SAFE_ID.pattern}")
    return BASE if round_ == 0 else f"{experiment}-r{round_:06d}"


def register_checkpoint(
    store: DeltaStore,
    *,
    checkpoint_id: str,
    round_: int,
    experiment: str,
    parent_id: str | None,
    path: str,
    step: int,
) -> None:
    row = {
        "checkpoint_id": checkpoint_id,
        "round": round_,
        "experiment": experiment,
        "parent_id": parent_id,
        "path": path,
        "step": step,
        "created_at": datetime.now(UTC),
    }
    store.overwrite("checkpoints", [row], f"checkpoint_id = '{checkpoint_id}'")


def register_deployment(
    store: DeltaStore,
    *,
    deployment_id: str,
    round_: int,
    checkpoint_id: str,
    path: str,
    quant_format: str,
    sampling_json: str,
) -> None:
    """Add (or replace) a deployment. A new one is not live until `set_live` says so; a
    replaced one keeps its live flag (re-registering in a replay never drops the live pointer)."""
    live = live_deployment(store)
    row = {
        "deployment_id": deployment_id,
        "round": round_,
        "checkpoint_id": checkpoint_id,
        "path": path,
        "quant_format": quant_format,
        "sampling_json": sampling_json,
        "live": live is not None and live["deployment_id"] == deployment_id,
        "created_at": datetime.now(UTC),
    }
    store.overwrite("deployments", [row], f"deployment_id = '{deployment_id}'")


def export_of(row: dict) -> str:
    """A deployments row's export: its path and when it was registered. A re-export is another
    export even at the same path (locally, a re-run of a round replaces the folder in place)."""
    created = row.get("created_at")
    return f"{row['path']}@{created.isoformat() if created is not None else ''}"


def children(store: DeltaStore, checkpoint_id: str) -> list[str]:
    """The checkpoints trained from `checkpoint_id` (sorted ids)."""
    return sorted(
        r["checkpoint_id"] for r in store.read("checkpoints").to_pylist() if r["parent_id"] == checkpoint_id
    )


def lookup(store: DeltaStore, table: str, key: str, value: str) -> dict:
    """The registry row whose `key` equals `value`; KeyError with the known values otherwise."""
    rows = [r for r in store.read(table).to_pylist() if r[key] == value]
    if not rows:
        raise KeyError(f"{table}: no row with {key} = {value!r}; has it been materialized?")
    return rows[0]


def set_live(store: DeltaStore, deployment_id: str) -> None:
    """Move the live pointer: one atomic commit flips `live` on the deployments registry."""
    move_live(store, deployment_id, lambda _: True)


def move_live(
    store: DeltaStore, deployment_id: str, allowed: Callable[[dict | None], bool], attempts: int = 5
) -> bool:
    """Compare-and-set of the live pointer: read the registry, and move live to `deployment_id`
    only if `allowed(the live row read)`, in a commit that fails when the registry changed since
    the read (then read and decide again). Returns whether live moved."""
    if not SAFE_ID.fullmatch(deployment_id):
        raise ValueError(f"deployment id {deployment_id!r} must match {SAFE_ID.pattern}")
    for attempt in range(attempts):
        dt = store.table("deployments")
        rows = store.read("deployments", version=dt.version()).to_pylist()
        if deployment_id not in {r["deployment_id"] for r in rows}:
            raise KeyError(f"deployment {deployment_id!r} is not registered")
        if not allowed(_live_of(rows)):
            return False
        try:
            store.update(
                "deployments", dt, {"live": f"deployment_id = '{deployment_id}'"}, {"live": deployment_id}
            )
            return True
        except CommitFailedError:  # another writer committed since the read
            time.sleep(random.uniform(0, 0.02 * 2**attempt))
    raise RuntimeError(f"the deployments registry kept changing; live not moved to {deployment_id}")


def live_deployment(store: DeltaStore) -> dict | None:
    """The deployments row marked live (None before the first deployment goes live)."""
    return _live_of(store.read("deployments").to_pylist())


def _live_of(rows: list[dict]) -> dict | None:
    live = [r for r in rows if r["live"]]
    if len(live) > 1:
        raise RuntimeError(f"{len(live)} deployments are marked live; expected one")
    return live[0] if live else None
