"""Cross-round lineage as data (docs/operations.md): the checkpoint registry (with parent pointers) and
the deployments registry (with the explicit `live` pointer only the deployment asset moves)."""

from __future__ import annotations

from datetime import UTC, datetime

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
    """Add (or replace) a deployment. A new one is not live until `store.set_live` says so; a
    replaced one keeps its live flag (re-registering in a replay never drops the live pointer)."""
    live = store.live_deployment()
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
