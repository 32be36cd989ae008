"""Commits of a local Delta table written by the store itself, and the table's files as those
commits leave them.

A commit is a file of the Delta log, `_delta_log/<version>.json`: one action a line. The store's
own commit of a file it wrote (an append, or a round overwrite removing the round's files) holds a
`commitInfo` (the operation and the store's commit metadata, as deltalake writes them), a `txn` for
each app transaction, a `remove` for each file replaced and the `add`. It is written to a temporary
file in the log and linked to the version's name: the link fails if that name exists, so of two
writers only one gets a version (the put-if-absent Delta's protocol asks of a log store), and the
one that lost hands its commit to deltalake, whose conflict checks decide it.

deltalake keeps none of the state a commit of file actions produces, and bringing its snapshot up
to date costs ~2 ms a commit (docs/performance.md); `LiveFiles` is what the store's own commits
leave: the version and each live file's partition value and size, read from deltalake's snapshot
once and advanced by each own commit, so that reads and writes between deltalake's catch-ups are
served from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import AddAction

from prodrl_pipeline.records.delta_files import PARTITION, DataFile, commit_file_path

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
"""commitInfo fields the writer sets: commit metadata may not name them (deltalake refuses them too;
a reader parses them, so a string where it expects a number makes the table's history unreadable)."""


@dataclass(frozen=True)
class LiveFiles:
    """A local table at `version`: its live files, each a path as the log holds it (relative, URL
    encoded) with its partition value as the log writes it (None: a null round, or no partition)
    and its size in bytes."""

    version: int
    files: dict[str, tuple[str | None, int]]

    @classmethod
    def of(cls, table: DeltaTable) -> LiveFiles | None:
        """The files `table`'s snapshot lists; None if one is not in the table's folder (an object
        store's, named by a URI)."""
        adds = pa.table(table.get_add_actions(flatten=True))
        paths, sizes = adds["path"].to_pylist(), adds["size_bytes"].to_pylist()
        if any("://" in path for path in paths):
            return None
        column = f"partition.{PARTITION}"
        values = adds[column].to_pylist() if column in adds.column_names else [None] * len(paths)
        return cls(
            table.version(),
            {
                path: (None if value is None else str(value), size)
                for path, value, size in zip(paths, values, sizes, strict=True)
            },
        )

    def data_files(self, folder: str, partitioned: bool, round_: int | None) -> list[DataFile]:
        """The live files as paths in `folder` (only those of `round_` if given, for a table
        partitioned by round)."""
        return [
            DataFile(os.path.join(folder, unquote(path)), partitioned, None if value is None else int(value))
            for path, (value, _) in self.files.items()
            if not (partitioned and round_ is not None and value != str(int(round_)))
        ]

    def of_partition(self, value: str | None) -> list[str]:
        return [path for path, (v, _) in self.files.items() if v == value]

    def after(self, add: AddAction, removed: list[str]) -> LiveFiles:
        files = {path: kept for path, kept in self.files.items() if path not in removed}
        files[add.path] = (add.partition_values.get(PARTITION), add.size)
        return LiveFiles(self.version + 1, files)


def commit(
    folder: str,
    live: LiveFiles,
    add: AddAction,
    removed: list[str],
    transactions: list[tuple[str, int]],
    operation: dict,
    metadata: dict[str, str],
) -> bool:
    """Commit `add`, removing the files `removed`, as version `live.version + 1` of the table in
    `folder`; False (nothing committed) if another writer holds that version. `operation` is the
    commitInfo's operation parameters; `metadata` its custom keys."""
    if clash := RESERVED.intersection(metadata):
        raise ValueError(f"commit metadata may not set the commitInfo fields {sorted(clash)}")
    now = int(time.time() * 1000)
    info = {
        "timestamp": now,
        "operation": "WRITE",
        "operationParameters": operation,
        "engineInfo": "prodrl",
        "clientVersion": "prodrl",
        **metadata,
    }
    actions: list[dict] = [{"commitInfo": info}]
    actions += [{"txn": {"appId": app, "version": version}} for app, version in transactions]
    for path in removed:
        value, size = live.files[path]
        remove = {"path": path, "dataChange": True, "deletionTimestamp": now, "extendedFileMetadata": True}
        actions.append({"remove": {**remove, "partitionValues": _values(add, value), "size": size}})
    actions.append(
        {
            "add": {
                "path": add.path,
                "partitionValues": add.partition_values,
                "size": add.size,
                "modificationTime": add.modification_time,
                "dataChange": True,
                "stats": add.stats,
            }
        }
    )
    target = commit_file_path(folder, live.version + 1)
    temporary = os.path.join(os.path.dirname(target), f"_commit_{uuid.uuid4()}.json.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(action) + "\n" for action in actions))
        try:
            os.link(temporary, target)
        except FileExistsError:  # another writer's; or our own link that landed (a retried call)
            return os.path.samefile(temporary, target)
        return True
    finally:  # the commit stands whatever happens here; a leftover temporary file is never read
        with contextlib.suppress(OSError):
            os.remove(temporary)


def _values(add: AddAction, value: str | None) -> dict[str, str | None]:
    """A removed file's partition values, in the form its table's adds have."""
    return {PARTITION: value} if add.partition_values else {}
