"""A local Delta table's data files, read and written with pyarrow: the files a snapshot lists, and a
new file with the add action (partition value, size, statistics) that commits it.

deltalake's own writer takes ~1.3× as long as a pyarrow write of the same rows; a file pyarrow
writes, committed by `DeltaTable.create_write_transaction`, ~1.25× with its statistics, the commit
and the kept snapshot's refresh (docs/performance.md). The commit goes through deltalake: its
retries and app transactions are its own.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.transaction import AddAction

PARTITION = "round"
"""The one partition column of a partitioned table."""
STRING_STATS = 32
"""Characters kept of a string bound: a longer minimum is cut (its prefix is below it), a longer
maximum cut and raised (`_above`)."""
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"


@dataclass(frozen=True)
class DataFile:
    """One file of a snapshot: its absolute local path and, in a partitioned table, its partition
    value (None: a null round)."""

    path: str
    partitioned: bool
    round: int | None


def local_folder(table: DeltaTable) -> str:
    return unquote(table.table_uri.removeprefix("file://"))


def read_file(file: DataFile, round_: int | None) -> pa.Table:
    """One file's rows (those of `round_` if given); a partitioned table's `round` is the file's
    partition value (the log's, null included), not a column of the file."""
    with pq.ParquetFile(file.path) as f:
        part = f.read()
    if file.partitioned:  # another writer may have kept the partition column in its files too
        part = part.drop_columns([c for c in part.column_names if c == PARTITION])
        return part.append_column(PARTITION, pa.repeat(pa.scalar(file.round, pa.int64()), part.num_rows))
    if round_ is not None:
        return part.filter(pc.equal(part[PARTITION], int(round_)))
    return part


def write_file(folder: str, data: pa.Table, partition: int | None, partitioned: bool) -> AddAction:
    """Write `data` as a new parquet file of the table in `folder` (a partitioned table's rows all
    have `partition` as their round; the file does not hold the column) and return the add action
    that commits it. A file left by a write that fails is removed."""
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    if partitioned:
        name = f"{PARTITION}={HIVE_NULL if partition is None else partition}/{name}"
        data = data.drop_columns([PARTITION])
    path = os.path.join(folder, name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(data, path, compression="snappy")
        size = os.path.getsize(path)
    except BaseException:
        if os.path.exists(path):
            os.remove(path)
        raise
    return AddAction(
        path=name,  # letters, digits and -_=/. only: the log's URL encoding of it is itself
        size=size,
        partition_values={PARTITION: None if partition is None else str(partition)} if partitioned else {},
        modification_time=int(time.time() * 1000),
        data_change=True,
        stats=json.dumps(file_stats(data)),
    )


def file_stats(data: pa.Table) -> dict:
    """Delta's per-file statistics of the scalar columns (struct fields nested): numRecords, nullCount
    and, for a column with a value, minValues/maxValues: of numbers and booleans (floats as
    `_float_bounds` says), strings (cut to STRING_STATS characters, the maximum raised) and
    timestamps (milliseconds, rounded outwards). Lists get none, as deltalake's writer gives them
    none. Every scalar column with a value gets bounds: a reader may take a column with a null count
    and no bounds as one of nulls only (deltalake's pyarrow dataset does)."""
    low: dict = {}
    high: dict = {}
    nulls: dict = {}
    for field, column in zip(data.schema, data.columns, strict=True):
        _column_stats(field, column, low, high, nulls)
    return {"numRecords": data.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls}


def _column_stats(field: pa.Field, column: pa.ChunkedArray, low: dict, high: dict, nulls: dict) -> None:
    kind = field.type
    if pa.types.is_struct(kind):
        inner: tuple[dict, dict, dict] = ({}, {}, {})
        for i, child in enumerate(kind):
            _column_stats(child, pc.struct_field(column, [i]), *inner)
        for out, got in zip((low, high, nulls), inner, strict=True):
            if got:
                out[field.name] = got
        return
    if not (
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_string(kind)
        or pa.types.is_timestamp(kind)
        or pa.types.is_boolean(kind)
    ):
        return
    nulls[field.name] = column.null_count
    if column.null_count == len(column):
        return
    bounds = pc.min_max(column)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if pa.types.is_floating(kind):
        low[field.name], high[field.name] = _float_bounds(column, lo, hi, kind)
        return
    if pa.types.is_string(kind):
        low[field.name], high[field.name] = lo[:STRING_STATS], _above(hi)
        return
    if pa.types.is_timestamp(kind):
        low[field.name], high[field.name] = _millis(lo, up=False), _millis(hi, up=True)
        return
    low[field.name], high[field.name] = lo, hi


def _float_bounds(column: pa.ChunkedArray, lo: float, hi: float, kind: pa.DataType) -> tuple[float, float]:
    """A float column's bounds. With a NaN or an infinity, the type's widest finite ones: engines
    order NaN differently, JSON holds neither, and DataFusion reads a column whose bounds are equal
    as that one value (a NaN among zeros became 0.0). A zero bound is signed outwards (-0.0 below,
    0.0 above), as parquet's statistics are: equal zero bounds would erase a zero's sign."""
    if pc.any(pc.is_nan(column)).as_py() or not (math.isfinite(lo) and math.isfinite(hi)):
        widest = float(np.finfo(kind.to_pandas_dtype()).max)
        return -widest, widest
    return (-0.0 if lo == 0 else lo), (0.0 if hi == 0 else hi)


def _above(text: str) -> str:
    """`text` if it is at most STRING_STATS characters, else a string of at most that many that
    sorts above it (and above every string it prefixes): its prefix with the last character that
    can be raised raised by one code point (UTF-8's byte order is the code points' order)."""
    if len(text) <= STRING_STATS:
        return text
    prefix = text[:STRING_STATS]
    while prefix and ord(prefix[-1]) == 0x10FFFF:
        prefix = prefix[:-1]
    if not prefix:  # only the last code point: no shorter string is above it
        return text
    raised = ord(prefix[-1]) + 1
    return prefix[:-1] + chr(0xE000 if 0xD800 <= raised <= 0xDFFF else raised)  # no surrogates


def _millis(value: datetime.datetime, up: bool) -> str:
    """A timestamp as Delta's statistics write it: UTC, milliseconds, rounded down or up."""
    value = value.astimezone(datetime.UTC) if value.tzinfo else value.replace(tzinfo=datetime.UTC)
    if up and value.microsecond % 1000:
        value += datetime.timedelta(microseconds=1000 - value.microsecond % 1000)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def newer_commit(table: DeltaTable) -> bool:
    """Whether the local `table` has a commit after its snapshot's: the next version's commit file
    exists (a stat, ~10 µs, where deltalake's look takes ~0.5 ms)."""
    return commit_exists(local_folder(table), table.version() + 1)


def commit_exists(folder: str, version: int) -> bool:
    """Whether the local table in `folder` has a commit at `version` (a stat)."""
    return os.path.exists(commit_file_path(folder, version))


def log_identity(table: DeltaTable) -> tuple[int, int, int] | None:
    """The commit file of the local `table`'s snapshot version, as (inode, size, modification time
    in ns); None if it is gone. Another value means another file (an inode is reused at once): the
    table was deleted and made anew."""
    try:
        stat = os.stat(commit_file_path(local_folder(table), table.version()))
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def commit_file_path(folder: str, version: int) -> str:
    return os.path.join(folder, "_delta_log", f"{version:020d}.json")


def commit_version(folder: str, path: str, after: int, latest: int) -> int:
    """The version, in (after, latest], whose commit added the file at `path` (relative, as in the
    log): read from the commit files, as deltalake does not return the version it committed."""
    for version in range(after + 1, latest + 1):
        with open(commit_file_path(folder, version), encoding="utf-8") as f:
            actions = [json.loads(line) for line in f if line.strip()]
        if any(action.get("add", {}).get("path") == path for action in actions):
            return version
    raise RuntimeError(f"no commit in versions {after + 1}..{latest} adds {path}")
