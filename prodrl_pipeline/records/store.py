"""Delta Lake storage of every table under one root (a local folder or an object-store URI).

Per-round tables are written with a predicate overwrite (`round = k`), so re-materializing a
round replaces its rows and never duplicates them. Queries run on DataFusion (deltalake's
QueryBuilder): the one SQL engine of the project.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import (
    CommitProperties,
    DeltaTable,
    PostCommitHookProperties,
    QueryBuilder,
    Transaction,
    write_deltalake,
)
from deltalake.exceptions import CommitFailedError, DeltaError

from prodrl_pipeline.records.schema import TABLES

log = logging.getLogger(__name__)

SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]+")  # ids that may appear inside a SQL predicate
PARTITIONED = {"calls", "trajectories", "advantages", "train_steps", "policy_logprobs", "eval_results"}
CHECKPOINT_INTERVAL = 10
"""Commits between the log checkpoints this store writes. Opening a table replays every commit
since its last checkpoint (~0.5 ms each): a long-lived table taking many small appends (the
gateway's) opens in a bounded time (deltalake's own default is 100)."""
TABLE_PROPERTIES = {
    "delta.checkpointInterval": str(CHECKPOINT_INTERVAL),
    # never delete commit files on a commit: a pinned version (a replay) stays readable however old
    "delta.enableExpiredLogCleanup": "false",
}
"""Set on every table this store creates, and by `maintain` on older ones."""
NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
"""A commit writes no checkpoint of its own (`_checkpoint` does, best effort) and deletes no log."""


class StorageError(OSError):
    """A table write failed for a reason of the storage's (no space, read-only, unreachable), or a
    table's Delta log is corrupt."""


def _one_line(error: Exception) -> str:
    """deltalake's error chain (colored, one cause per line) as one plain line."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
    return ": ".join(part for line in lines if (part := line.strip().removeprefix("↳").strip()))


def _read_files(dt: DeltaTable, round_: int | None) -> list[pa.Table] | None:
    """A reader-protocol-1 snapshot's rows, one table per parquet file its log lists (optionally the
    files of one round); None if a file is not in the table's local folder. A partitioned table's
    `round` is each file's partition value in the log (null included), not a column of the file."""
    adds = pa.table(dt.get_add_actions(flatten=True))
    paths = adds["path"].to_pylist()
    if any("://" in path for path in paths):
        return None
    folder = unquote(urlparse(dt.table_uri).path)  # the log's paths are relative and URL-encoded
    partitioned = "round" in dt.metadata().partition_columns
    values = adds["partition.round"].to_pylist() if partitioned else [None] * len(paths)
    parts = []
    for path, value in zip(paths, values, strict=True):
        if partitioned and round_ is not None and value != int(round_):
            continue
        part = pq.read_table(os.path.join(folder, unquote(path)))
        if partitioned:  # another writer may have kept the partition column in its files too
            part = part.drop_columns([c for c in part.column_names if c == "round"])
            part = part.append_column("round", pa.array([value] * part.num_rows, pa.int64()))
        elif round_ is not None:
            part = part.filter(pc.equal(part["round"], int(round_)))
        parts.append(part)
    return parts


def _read_sql(dt: DeltaTable, round_: int | None) -> pa.Table:
    where = f" WHERE round = {int(round_)}" if round_ is not None else ""
    return pa.table(QueryBuilder().register("t", dt).execute(f"SELECT * FROM t{where}").read_all())


def _as_schema(data: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rows read from a table as `schema` (string views, large types and column order as ours); a
    file written by an older prodrl lacks newer (nullable) columns: they are filled with nulls."""
    for field in schema:
        if field.name not in data.column_names:
            data = data.append_column(field.name, pa.nulls(data.num_rows, field.type))
    return data.select(schema.names).cast(schema)


class DeltaStore:
    """The project's tables under `root` (a folder or an object-store URI such as s3://bucket/tables,
    reached with `storage_options`: endpoint, credentials, region); `commit_metadata` is attached to
    every commit (e.g. the Dagster run id), visible in each table's `history()`. On S3, commits are
    conditional writes: concurrent writers need no lock service.

    With `lineage`, `versions_read` and `versions_written` hold, per table, every version this store
    object read (`read`, `query`) and committed (the version its own commit got, after any rebase
    over another writer's). Off by default: a long-lived writer (the gateway) would grow them."""

    def __init__(
        self,
        root: str | Path,
        commit_metadata: Mapping[str, str] | None = None,
        storage_options: Mapping[str, str] | None = None,
        lineage: bool = False,
    ):
        self.root = str(root).rstrip("/")
        self.commit_metadata = dict(commit_metadata or {})
        self.storage_options = dict(storage_options or {}) or None
        self.lineage = lineage
        self.versions_read: dict[str, set[int]] = {}
        self.versions_written: dict[str, set[int]] = {}

    def uri(self, table: str) -> str:
        if table not in TABLES:
            raise KeyError(f"unknown table {table!r}; known: {sorted(TABLES)}")
        return f"{self.root}/{table}"

    def exists(self, table: str) -> bool:
        with self._reading(table):
            return DeltaTable.is_deltatable(self.uri(table), storage_options=self.storage_options)

    def table(self, table: str, version: int | None = None) -> DeltaTable:
        with self._reading(table):
            return DeltaTable(self.uri(table), version=version, storage_options=self.storage_options)

    @contextmanager
    def _reading(self, *tables: str) -> Iterator[None]:
        """Re-raise deltalake's generic DeltaError for a log that does not parse (a commit file in
        `_delta_log` truncated or garbled; deltalake says "Json error"), and a storage failure
        (unreachable, refused, throttled), as a StorageError naming the table (or the tables a
        query read)."""
        names = ", ".join(f"{t!r} ({self.uri(t)})" for t in tables)
        try:
            yield
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"table {names} cannot be read: the storage failed: {_one_line(e)}") from e
        except DeltaError as e:
            if "Json error" not in str(e):
                raise
            raise StorageError(
                f"table {names} is unreadable: its Delta log is corrupt, a commit file "
                f"in _delta_log is truncated or garbled ({str(e).splitlines()[0]})"
            ) from e

    def _commit(
        self, extra: Mapping[str, str] | None, transaction: tuple[str, int] | None = None
    ) -> CommitProperties:
        txns = [Transaction(app_id=transaction[0], version=transaction[1])] if transaction else None
        return CommitProperties(
            custom_metadata={**self.commit_metadata, **(extra or {})}, app_transactions=txns
        )

    def _seen(self, versions: dict[str, set[int]], table: str, version: int) -> None:
        if self.lineage:
            versions.setdefault(table, set()).add(version)

    def _read(self, table: str, version: int | None) -> DeltaTable:
        dt = self.table(table, version)
        self._seen(self.versions_read, table, dt.version())
        return dt

    def _conform(self, table: str, rows: pa.Table | Sequence[dict]) -> pa.Table:
        schema = TABLES[table]
        if isinstance(rows, pa.Table):
            return rows.select(schema.names).cast(schema)
        return pa.Table.from_pylist(list(rows), schema=schema)

    def overwrite(self, table: str, rows: pa.Table | Sequence[dict], predicate: str) -> int:
        """Replace the rows matching `predicate` (e.g. "round = 3") by `rows`; returns the count."""
        data = self._conform(table, rows)
        partition_by = ["round"] if table in PARTITIONED else None
        commit = self._commit({"predicate": predicate})
        if not self.exists(table):
            self._write(table, data, mode="overwrite", partition_by=partition_by, commit_properties=commit)
        else:
            self._write(
                table,
                data,
                mode="overwrite",
                predicate=predicate,
                partition_by=partition_by,
                schema_mode="merge",  # a column added in a newer prodrl is added to the table
                commit_properties=commit,
            )
        return data.num_rows

    def _write(self, table: str, data: pa.Table, **kwargs: object) -> None:
        """write_deltalake through the table's latest snapshot (its uri when the write creates it),
        so the version the commit got, rebased over other writers', is known; a failure other than a
        lost commit race (disk full, read-only storage, a lost connection) is reported as a
        StorageError naming the table, which stays readable at its last committed version (a Delta
        commit is atomic)."""
        try:
            target = self.table(table) if self.exists(table) else None
            if target is None:
                write_deltalake(
                    self.uri(table),
                    data,
                    storage_options=self.storage_options,
                    configuration=TABLE_PROPERTIES,
                    post_commithook_properties=NO_HOOKS,
                    **kwargs,
                )
            else:
                write_deltalake(target, data, post_commithook_properties=NO_HOOKS, **kwargs)
        except (CommitFailedError, StorageError):  # a lost race; or the snapshot's read named the table
            raise
        except (DeltaError, OSError) as e:
            if "Json error" in str(e):  # its log is corrupt: the read says so, naming the table
                self.table(table)
            raise StorageError(
                f"writing {data.num_rows} rows to table {table!r} failed: {_one_line(e)}; the table stays "
                f"at its last committed version ({self._last_version(table)})"
            ) from e
        self._seen(self.versions_written, table, 0 if target is None else target.version())
        if target is not None:
            self._checkpoint(table, target)

    def _checkpoint(self, table: str, dt: DeltaTable) -> None:
        """After a commit (`dt` at its version): a log checkpoint every CHECKPOINT_INTERVAL versions,
        best effort. The commit has landed whatever happens here: a checkpoint that cannot be
        written (no space, storage refused) is logged, never reported as a failed write."""
        if dt.version() % CHECKPOINT_INTERVAL:
            return
        try:
            dt.create_checkpoint()
        except (DeltaError, OSError) as e:
            log.warning("table %r: the log checkpoint at version %d failed: %s", table, dt.version(), e)

    def _last_version(self, table: str) -> str:
        """The table's version for an error message; the storage may be what failed."""
        try:
            return str(self.table(table).version()) if self.exists(table) else "none"
        except (DeltaError, OSError) as e:
            return f"unknown: reading it failed too, {type(e).__name__}"

    def overwrite_round(self, table: str, rows: pa.Table | Sequence[dict], round_: int) -> int:
        return self.overwrite(table, rows, f"round = {int(round_)}")

    def append(
        self,
        table: str,
        rows: pa.Table | Sequence[dict],
        transaction: tuple[str, int] | None = None,
        check: bool = True,
    ) -> bool:
        """Append rows. With `transaction` = (app_id, version) the commit records that app version
        and, with `check`, is skipped (returns False) when the table already holds it or a later
        one: Delta rejects a concurrent duplicate itself but accepts a sequential one. A writer
        that knows it is the app's only writer and is past its replay may skip the check."""
        if transaction and check and self.transaction_version(table, transaction[0]) >= transaction[1]:
            return False
        self._write(
            table,
            self._conform(table, rows),
            mode="append",
            partition_by=["round"] if table in PARTITIONED else None,
            schema_mode="merge",
            commit_properties=self._commit(None, transaction),
        )
        return True

    def transaction_version(self, table: str, app_id: str) -> int:
        """The last version committed by `app_id` to `table`, -1 if none."""
        if not self.exists(table):
            return -1
        version = self.table(table).transaction_version(app_id)
        return -1 if version is None else version

    def read(self, table: str, round_: int | None = None, version: int | None = None) -> pa.Table:
        """Rows of `table` (optionally one round, at a pinned version); empty if it doesn't exist.
        A plain table (Delta reader protocol 1: no deletion vectors, no column mapping) in a local
        folder is read as the parquet files its log lists, with pyarrow; any other through
        DataFusion. Not with pyarrow's dataset scan of the Delta table: that can abort the
        interpreter at exit (its thread pool calling back into deltalake's Python filesystem)."""
        if not self.exists(table):
            return TABLES[table].empty_table()
        dt = self._read(table, version)
        with self._reading(table):  # the log's per-file stats are parsed only now
            parts = _read_files(dt, round_) if self._plain(dt) else None
            parts = [_read_sql(dt, round_)] if parts is None else parts
        schema = TABLES[table]
        return pa.concat_tables([_as_schema(p, schema) for p in parts]) if parts else schema.empty_table()

    def _plain(self, dt: DeltaTable) -> bool:
        """Whether `dt`'s files are all there is to read: a local table of reader protocol 1."""
        protocol = dt.protocol()
        local = "://" not in self.root or self.root.startswith("file://")
        return local and protocol.min_reader_version == 1 and not protocol.reader_features

    def query(self, sql: str, tables: Sequence[str], versions: Mapping[str, int] | None = None) -> pa.Table:
        """Run DataFusion SQL over the named tables (each registered under its own name, at its
        pinned version in `versions` if it has one, else the latest)."""
        qb = QueryBuilder()
        for name in tables:
            qb.register(name, self._read(name, (versions or {}).get(name)))
        with self._reading(*tables):  # the log's per-file stats are parsed only now
            return pa.table(qb.execute(sql).read_all())

    def maintain(self, table: str, retention_hours: int) -> dict:
        """Compact small files, vacuum files unreferenced for `retention_hours` (keep it >= the
        replay window: pinned versions older than that can no longer be read) and checkpoint the log."""
        dt = self.table(table)
        if any(dt.metadata().configuration.get(k) != v for k, v in TABLE_PROPERTIES.items()):
            # a table created before they were set
            dt.alter.set_table_properties(TABLE_PROPERTIES, post_commithook_properties=NO_HOOKS)
        compacted = dt.optimize.compact(post_commithook_properties=NO_HOOKS)
        vacuumed = dt.vacuum(retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False)
        dt.create_checkpoint()
        return {
            "files_removed": compacted.get("numFilesRemoved", 0),
            "files_added": compacted.get("numFilesAdded", 0),
            "vacuumed": len(vacuumed),
            "version": dt.version(),
        }

    def set_live(self, deployment_id: str) -> None:
        """Move the live pointer: one atomic commit flips `live` on the deployments registry."""
        self.move_live(deployment_id, lambda _: True)

    def move_live(
        self, deployment_id: str, allowed: Callable[[dict | None], bool], attempts: int = 5
    ) -> bool:
        """Compare-and-set of the live pointer: read the registry, and move live to `deployment_id`
        only if `allowed(the live row read)`, in a commit that fails when the registry changed since
        the read (then read and decide again). Returns whether live moved."""
        if not SAFE_ID.fullmatch(deployment_id):
            raise ValueError(f"deployment id {deployment_id!r} must match {SAFE_ID.pattern}")
        for _ in range(attempts):
            dt = self.table("deployments")
            rows = self.read("deployments", version=dt.version()).to_pylist()
            if deployment_id not in {r["deployment_id"] for r in rows}:
                raise KeyError(f"deployment {deployment_id!r} is not registered")
            if not allowed(self._live_of(rows)):
                return False
            try:
                dt.update(
                    updates={"live": f"deployment_id = '{deployment_id}'"},
                    commit_properties=self._commit({"live": deployment_id}),
                    post_commithook_properties=NO_HOOKS,
                )
                self._checkpoint("deployments", dt)
                self._seen(self.versions_written, "deployments", dt.version())
                return True
            except CommitFailedError:  # another writer committed since the read
                continue
        raise RuntimeError(f"the deployments registry kept changing; live not moved to {deployment_id}")

    @staticmethod
    def _live_of(rows: list[dict]) -> dict | None:
        live = [r for r in rows if r["live"]]
        if len(live) > 1:
            raise RuntimeError(f"{len(live)} deployments are marked live; expected one")
        return live[0] if live else None

    def live_deployment(self) -> dict | None:
        return self._live_of(self.read("deployments").to_pylist())
