"""Delta Lake storage of every table under one root (a local folder or an object-store URI).

Every write goes through deltalake's own writer. Per-round tables are written with a predicate
overwrite (`round = k`), so re-materializing a round replaces its rows and never duplicates them;
an overwrite that loses a race to another writer's commit is run again from the new version, so
what it leaves in the round is its rows and nothing another writer appended meanwhile. Reads and
queries run on DataFusion (deltalake's QueryBuilder): the one SQL engine of the project, and not
pyarrow's dataset scan of a Delta table, which can abort the interpreter at exit (its thread pool
calling back into deltalake's Python filesystem).

A store keeps each table's latest snapshot and brings it up to date before each read or write (the
commits since it was last used: ~0.5 ms, against ~8 ms to open the table).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
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

PARTITION = "round"
"""The one partition column of a partitioned table."""
PARTITIONED = {"calls", "trajectories", "advantages", "train_steps", "policy_logprobs", "eval_results"}
ROUND_PREDICATE = re.compile(r"round = (-?[0-9]+)")
SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]+")  # ids that may appear inside a SQL predicate
OVERWRITE_ATTEMPTS = 5
"""Times an overwrite is committed before its lost races are reported: each loss means another
writer committed to the rows it replaces, and the next attempt replaces them from the new version."""
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
RESERVED = frozenset(
    {
        "timestamp",
        "operation",
        "operationParameters",
        "engineInfo",
        "clientVersion",
        "readVersion",
        "isBlindAppend",
        "operationMetrics",
        "inCommitTimestamp",
    }
)
"""commitInfo fields the writer sets: commit metadata may not name them (deltalake refuses them at
the first write; the store when it is made)."""


class StorageError(OSError):
    """A table write failed for a reason of the storage's (no space, read-only, unreachable), or a
    table's Delta log is corrupt."""


def _one_line(error: Exception) -> str:
    """deltalake's error chain (colored, one cause per line) as one plain line."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
    return ": ".join(part for line in lines if (part := line.strip().removeprefix("↳").strip()))


def _read_sql(dt: DeltaTable, round_: int | None) -> pa.Table:
    where = f" WHERE round = {int(round_)}" if round_ is not None else ""
    return pa.table(QueryBuilder().register("t", dt).execute(f"SELECT * FROM t{where}").read_all())


def _as_schema(data: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rows read from a table as `schema` (string views, large types and column order as ours); a
    file written by an older prodrl lacks newer (nullable) columns: they are filled with nulls."""
    for field in schema:
        if field.name not in data.column_names:
            data = data.append_column(field.name, pa.nulls(data.num_rows, field.type))
    data = data.select(schema.names)
    return data if data.schema.equals(schema) else data.cast(schema)


def _commit_file(dt: DeltaTable, version: int) -> Path:
    """A local table's commit file of `version`."""
    return Path(unquote(dt.table_uri.removeprefix("file://"))) / "_delta_log" / f"{version:020d}.json"


def _identity(dt: DeltaTable) -> tuple[int, int, int] | None:
    """The commit file of a local snapshot's version as (inode, size, modification time in ns);
    None if it is gone. Another value means another file: the table was deleted and made anew."""
    try:
        stat = _commit_file(dt, dt.version()).stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


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
        if clash := RESERVED.intersection(self.commit_metadata):
            raise ValueError(f"commit_metadata may not set the commitInfo fields {sorted(clash)}")
        self.storage_options = dict(storage_options or {}) or None
        self.lineage = lineage
        self.versions_read: dict[str, set[int]] = {}
        self.versions_written: dict[str, set[int]] = {}
        self._snapshots: dict[str, tuple[DeltaTable, tuple[int, int, int] | None]] = {}
        self._locks: dict[str, threading.Lock] = {}

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

    @contextmanager
    def _latest(self, table: str) -> Iterator[DeltaTable | None]:
        """The table's kept snapshot brought to its latest version, or None if the table does not
        exist, with the table's lock held (the store's threads share it: a gateway's landing and live
        follower). A read or write that fails drops it: the next one opens the table afresh, as does
        one that finds the snapshot's commit file gone or replaced (the table deleted and made anew
        under this store)."""
        with self._locks.setdefault(table, threading.Lock()):
            dt, identity = self._snapshots.get(table, (None, None))
            try:
                if dt is not None and self._local and _identity(dt) != identity:
                    dt = None
                if dt is None:
                    dt = self.table(table) if self.exists(table) else None
                elif not self._local or _commit_file(dt, dt.version() + 1).exists():
                    with self._reading(table):  # a local snapshot with no next commit file is current
                        dt.update_incremental()
                yield dt
                if dt is not None:  # at the version the body left it at (a write moves it)
                    self._snapshots[table] = (dt, _identity(dt) if self._local else None)
            except BaseException:
                self._snapshots.pop(table, None)
                raise

    @contextmanager
    def _snapshot(self, table: str, version: int | None) -> Iterator[DeltaTable | None]:
        """The latest snapshot (kept, locked), or the table at a pinned `version` (opened)."""
        if version is None:
            with self._latest(table) as dt:
                yield dt
        else:
            yield self.table(table, version) if self.exists(table) else None

    def _commit(
        self, extra: Mapping[str, str] | None, transaction: tuple[str, int] | None = None
    ) -> CommitProperties:
        """The commit's metadata (the store's and `extra`) and the caller's app transaction."""
        txns = [Transaction(app_id=transaction[0], version=transaction[1])] if transaction else None
        return CommitProperties(
            custom_metadata={**self.commit_metadata, **(extra or {})}, app_transactions=txns
        )

    def _seen(self, versions: dict[str, set[int]], table: str, version: int) -> None:
        if self.lineage:
            versions.setdefault(table, set()).add(version)

    def _conform(self, table: str, rows: pa.Table | Sequence[dict]) -> pa.Table:
        schema = TABLES[table]
        if isinstance(rows, pa.Table):
            rows = rows.select(schema.names)
            return rows if rows.schema.equals(schema) else rows.cast(schema)
        return pa.Table.from_pylist(list(rows), schema=schema)

    def overwrite(self, table: str, rows: pa.Table | Sequence[dict], predicate: str) -> int:
        """Replace the rows matching `predicate` (e.g. "round = 3") by `rows`; returns the count. A
        predicate of exactly `round = k` on a partitioned table replaces round k's files, and every
        row must be of round k (a ValueError names those that are not, before anything is written).
        A round overwrite whose commit loses a race to another writer's is made again from the new
        version, up to OVERWRITE_ATTEMPTS times: its rows are the round whatever the table held, so
        none of a racing append's rows stays in it. Any other overwrite's rows may have been built
        from a read the race made stale (the registry's): its lost race is raised, naming the table."""
        data = self._conform(table, rows)
        whole_round = table in PARTITIONED and (match := ROUND_PREDICATE.fullmatch(predicate)) is not None
        if whole_round:
            round_ = int(match[1])
            outside = data.num_rows - (pc.sum(pc.equal(data["round"], round_)).as_py() or 0)  # nulls too
            if outside:
                raise ValueError(
                    f"{outside} rows failed validation: the overwrite of table {table!r} replaces round "
                    f"{round_} and these rows have another round"
                )
        attempt = 1
        while True:
            try:
                self._write(table, data, {"predicate": predicate}, None, predicate)
                return data.num_rows
            except CommitFailedError as e:
                if not (whole_round and "concurrent" in str(e)) or attempt == OVERWRITE_ATTEMPTS:
                    raise CommitFailedError(
                        f"table {table!r}: the overwrite of {predicate} was not committed "
                        f"(attempt {attempt}): {_one_line(e)}"
                    ) from e
                attempt += 1
                log.info(
                    "table %r: the overwrite of %s lost a race; again: %s", table, predicate, _one_line(e)
                )

    def _write(
        self,
        table: str,
        data: pa.Table,
        extra: Mapping[str, str] | None,
        transaction: tuple[str, int] | None,
        predicate: str | None = None,
    ) -> None:
        """Append `data`, or overwrite the rows matching `predicate`, through the table's latest
        snapshot, so the version the commit got, rebased over other writers', is known. A lost
        commit race is raised as deltalake's CommitFailedError; any other failure (disk full,
        read-only storage, a lost connection) as a StorageError naming the table, which stays
        readable at its last committed version (a Delta commit is atomic)."""
        mode = "append" if predicate is None else "overwrite"
        commit = self._commit(extra, transaction)
        partition_by = [PARTITION] if table in PARTITIONED else None
        try:
            with self._latest(table) as target:
                if target is None:  # created by this write: as an append, so a table another writer
                    write_deltalake(  # made meanwhile loses nothing (an overwrite would replace it whole)
                        self.uri(table),
                        data,
                        mode="append",
                        partition_by=partition_by,
                        storage_options=self.storage_options,
                        configuration=TABLE_PROPERTIES,
                        commit_properties=commit,
                        post_commithook_properties=NO_HOOKS,
                    )
                    with self._reading(table):
                        created = DeltaTable(self.uri(table), storage_options=self.storage_options)
                    version = created.version()
                    self._snapshots[table] = (created, _identity(created) if self._local else None)
                else:
                    write_deltalake(
                        target,
                        data,
                        mode=mode,
                        predicate=predicate,
                        partition_by=partition_by,
                        schema_mode="merge",  # a column added in a newer prodrl is added to the table
                        commit_properties=commit,
                        post_commithook_properties=NO_HOOKS,
                    )
                    version = target.version()
                    self._checkpoint(table, target, version)
            if target is None and version > 0 and predicate is not None:
                # another writer made the table first: what it holds under the predicate is replaced
                return self._write(table, data, extra, transaction, predicate)
        except (CommitFailedError, StorageError):  # a lost race; or the snapshot's read named the table
            raise
        except (DeltaError, OSError) as e:
            if "Json error" in str(e):  # its log is corrupt: the read says so, naming the table
                self.table(table)
            raise StorageError(
                f"writing {data.num_rows} rows to table {table!r} failed: {_one_line(e)}; the table stays "
                f"at its last committed version ({self._last_version(table)})"
            ) from e
        self._seen(self.versions_written, table, version)

    def _checkpoint(self, table: str, dt: DeltaTable, version: int) -> None:
        """After a commit at `version` (`dt` at it): a log checkpoint every CHECKPOINT_INTERVAL
        versions, best effort. The commit has landed whatever happens here: a checkpoint that
        cannot be written (no space, storage refused) is logged, never reported as a failed write."""
        if version % CHECKPOINT_INTERVAL:
            return
        try:
            dt.create_checkpoint()
        except (DeltaError, OSError) as e:
            log.warning("table %r: the log checkpoint at version %d failed: %s", table, version, e)

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
        self._write(table, self._conform(table, rows), None, transaction)
        return True

    def transaction_version(self, table: str, app_id: str) -> int:
        """The last version committed by `app_id` to `table`, -1 if none."""
        with self._latest(table) as dt:
            version = None if dt is None else dt.transaction_version(app_id)
        return -1 if version is None else version

    def read(self, table: str, round_: int | None = None, version: int | None = None) -> pa.Table:
        """Rows of `table` (optionally one round, at a pinned version); empty if it doesn't exist.
        Read through DataFusion, whatever the table's protocol or storage."""
        with self._snapshot(table, version) as dt:
            if dt is None:
                return TABLES[table].empty_table()
            self._seen(self.versions_read, table, dt.version())
            with self._reading(table):  # the log's per-file stats are parsed only now
                data = _read_sql(dt, round_)
        return _as_schema(data, TABLES[table])

    @property
    def _local(self) -> bool:
        return "://" not in self.root or self.root.startswith("file://")

    def query(self, sql: str, tables: Sequence[str], versions: Mapping[str, int] | None = None) -> pa.Table:
        """Run DataFusion SQL over the named tables (each registered under its own name, at its
        pinned version in `versions` if it has one, else the latest)."""
        qb = QueryBuilder()
        for name in tables:
            dt = self.table(name, (versions or {}).get(name))
            self._seen(self.versions_read, name, dt.version())
            qb.register(name, dt)
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

    def update_if(
        self, table: str, row: dict, key: str, columns: Sequence[str], condition: str, attempts: int = 6
    ) -> bool:
        """Compare-and-set of one row: set `columns` of the row whose `key` equals `row[key]` to
        `row`'s values, only if the stored row matches `condition` (SQL over it as `t`, e.g.
        "t.status = 'open'"), judged at the version the commit lands on (a commit that loses a race
        is judged again from the new version, after a short random pause). Returns whether it did."""
        data = self._conform(table, [row])
        for attempt in range(attempts):
            try:
                with self._latest(table) as dt:
                    if dt is None:
                        return False
                    metrics = (
                        dt.merge(
                            data,
                            f"t.{key} = s.{key}",
                            source_alias="s",
                            target_alias="t",
                            commit_properties=self._commit({"update_if": condition}),
                            post_commithook_properties=NO_HOOKS,
                        )
                        .when_matched_update({c: f"s.{c}" for c in columns}, predicate=condition)
                        .execute()
                    )
                    if metrics["num_target_rows_updated"]:
                        self._checkpoint(table, dt, dt.version())
                        self._seen(self.versions_written, table, dt.version())
                    return metrics["num_target_rows_updated"] > 0
            except CommitFailedError:  # another writer committed since the read: judge again
                time.sleep(random.uniform(0, 0.02 * 2**attempt))
        raise RuntimeError(f"table {table!r} kept changing; {key} = {row[key]!r} not updated")

    def update(self, table: str, dt: DeltaTable, updates: Mapping[str, str], note: Mapping[str, str]) -> None:
        """Set `updates` (column: SQL expression over the row) on every row of `dt`, `table` as
        this store opened it with `table()`, in one commit noted with `note`. The commit raises
        CommitFailedError when another writer committed to the table since `dt`'s version
        (deltalake 1.6 refuses an update over appended rows as over rewritten files). `updates`
        is SQL: the caller validates any value it writes into it (e.g. `SAFE_ID`)."""
        dt.update(
            updates=dict(updates),
            commit_properties=self._commit(note),
            post_commithook_properties=NO_HOOKS,
        )
        self._checkpoint(table, dt, dt.version())
        self._seen(self.versions_written, table, dt.version())
