"""The SQL of `sql/`, run with DataFusion over the Delta tables (the project's one SQL engine).

SQL files take `{name}` parameters; only integers and validated ids are substituted.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa

from prodrl_pipeline.records.store import SAFE_ID, DeltaStore

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"


def run_sql(
    store: DeltaStore,
    name: str,
    tables: list[str],
    versions: Mapping[str, int] | None = None,
    **params: int | str,
) -> pa.Table:
    """`sql/<name>.sql` with `params` over `tables` (at their `versions`, else the latest)."""
    for key, value in params.items():
        if isinstance(value, str) and not SAFE_ID.fullmatch(value):
            raise ValueError(f"SQL parameter {key}={value!r} must match {SAFE_ID.pattern}")
    sql = (SQL_DIR / f"{name}.sql").read_text().format(**params)
    return store.query(sql, tables, versions)


def compute_advantages(store: DeltaStore, round_: int, batch_size: int, steps: int, seed: int) -> pa.Table:
    """One row per trained trajectory: minibatch, reward, batch-mean baseline, advantage."""
    for name, value in (("batch_size", batch_size), ("steps", steps)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return run_sql(
        store,
        "advantages",
        ["trajectories"],
        round=int(round_),
        batch_size=int(batch_size),
        steps=int(steps),
        seed=int(seed),
    )


def round_summary(store: DeltaStore, experiment: str) -> list[dict]:
    """Per-round train reward, held-out solve rate and mismatch of one experiment; empty until
    the base deployment has been evaluated and one round has trained."""
    tables = ["trajectories", "train_steps", "eval_results"]
    if not all(store.exists(t) for t in tables):
        return []
    return run_sql(store, "round_summary", tables, experiment=experiment).to_pylist()


def training_summary(store: DeltaStore, experiment: str) -> list[dict]:
    """Per-round train reward and mismatch of the rounds one experiment trained (production mode:
    no held-out solve rate); empty until one round has trained."""
    tables = ["trajectories", "train_steps"]
    if not all(store.exists(t) for t in tables):
        return []
    return run_sql(store, "training_summary", tables, experiment=experiment).to_pylist()


def stored_results(store: DeltaStore, deployment_id: str) -> list[dict]:
    """The latest stored held-out evaluation of a deployment, one row per puzzle (empty if never
    evaluated)."""
    if not store.exists("eval_results"):
        return []
    rows = [r for r in store.read("eval_results").to_pylist() if r["deployment_id"] == deployment_id]
    last = max((r["round"] for r in rows), default=None)
    return [r for r in rows if r["round"] == last]
