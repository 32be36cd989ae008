"""Advantages from the round's trajectories, by the SQL in `sql/advantages.sql`."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from prodrl_pipeline.records.store import DeltaStore

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"


def compute_advantages(store: DeltaStore, round_: int, batch_size: int, steps: int, seed: int,
                       sql_dir: Path = SQL_DIR) -> pa.Table:
    """One row per trained trajectory: minibatch, reward, batch-mean baseline, advantage."""
    for name, value in (("batch_size", batch_size), ("steps", steps)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    sql = (sql_dir / "advantages.sql").read_text().format(
        round=int(round_), batch_size=int(batch_size), steps=int(steps), seed=int(seed)
    )
    return store.query(sql, ["trajectories"])
