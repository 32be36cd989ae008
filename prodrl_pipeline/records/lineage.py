"""From a round's number to its exact rows: the Delta versions a step read and wrote, absolute
locations, and a query a user pastes into Python to open the round's calls, trajectories and steps."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from prodrl_pipeline.records.store import DeltaStore

QUERY_TABLES = ("calls", "trajectories", "train_steps")
"""What `round_query` opens: the round's traffic as served, its scored episodes, its optimizer steps."""


def absolute_uri(uri: str) -> str:
    """An object-store URI as it is; a local path made absolute (metadata is read from anywhere)."""
    return uri if "://" in uri else str(Path(uri).resolve())


def versions(store: DeltaStore) -> dict[str, dict[str, list[int]]]:
    """Every Delta version `store` read and committed: {"read": {table: [v, ...]}, "written": {...}}."""
    return {
        kind: {table: sorted(vs) for table, vs in sorted(seen.items())}
        for kind, seen in (("read", store.versions_read), ("written", store.versions_written))
    }


def round_query(store: DeltaStore, round_: int, experiment: str, pinned: Mapping[str, int]) -> str:
    """Python (polars, which reads Delta through deltalake) that opens round `round_`'s rows of
    `QUERY_TABLES` at the `pinned` versions: the same rows whatever was written since. Object-store
    tables also need `storage_options=` with the store's credentials, which are never printed."""
    this_round = f'pl.col("round") == {round_}'

    def frame(name: str, table: str, where: str) -> str:
        return f'{name} = pl.read_delta(f"{{root}}/{table}", version={pinned[table]}).filter({where})'

    return "\n".join(
        [
            "import polars as pl",
            "",
            f"root = {absolute_uri(store.root)!r}",
            frame("calls", "calls", this_round),
            frame("trajectories", "trajectories", this_round),
            frame("steps", "train_steps", f'({this_round}) & (pl.col("experiment") == {experiment!r})'),
            "# one episode's calls, turn by turn:",
            'first = trajectories["trajectory_id"][0]',
            'episode = calls.filter(pl.col("trajectory_id") == first).sort("call_index")',
            "",
        ]
    )
