"""The gateway's landing log: durable in a local spool before the client is answered, committed to
Delta in batches, exactly once.

Each record is appended (one JSON line) to the open spool segment `seg-<n>.jsonl` before the
response is sent, so a crash, even SIGKILL, loses nothing a client saw answered. A flusher thread
seals the open segment when it holds `flush_records` records or is `flush_seconds` old and commits
every sealed segment as one append per table carrying the Delta app transaction (app_id, n); the
segment file is deleted only after its commits. On start, segments left on disk are committed
again: a commit that already landed is recognised by the table's transaction version and skipped,
so replay is exactly once. When more than `max_pending` records wait for a commit, `has_room` is
False and the server answers 503 instead of dropping records.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from prodrl_pipeline.records.schema import TABLES, from_json, json_value
from prodrl_pipeline.records.store import DeltaStore

log = logging.getLogger(__name__)
TABLE_OF = {"call": "landing_calls", "feedback": "landing_feedback", "reject": "rejects"}
HELD_SEGMENTS = 4  # segments whose rows stay in memory for their commit (a backlog is read back)


class LandingLog:
    def __init__(
        self,
        store: DeltaStore,
        spool_dir: str | Path,
        app_id: str | None = None,
        flush_records: int = 256,
        flush_seconds: float = 1.0,
        max_pending: int = 10_000,
        fsync: bool = False,
        tick: Callable[[], None] | None = None,
    ):
        if flush_records < 1 or flush_seconds <= 0 or max_pending < flush_records:
            raise ValueError("need flush_records >= 1, flush_seconds > 0 and max_pending >= flush_records")
        self.store, self.spool_dir, self.app_id = store, Path(spool_dir), app_id or ""
        self.flush_records, self.flush_seconds, self.max_pending = flush_records, flush_seconds, max_pending
        self.fsync, self.tick = fsync, tick
        self._cond = threading.Condition()
        self._sealed: list[tuple[int, Path]] = []
        # per segment written by this process: its records as validated Arrow rows, by table (the
        # commit concatenates them: no JSON parse, no Python-object conversion holding the GIL)
        self._rows: dict[int, dict[str, list[pa.Table]]] = {}
        self._file = None
        self._seq = 0
        self._open_count = 0
        self._opened_at = 0.0
        self._pending = 0
        self._running = False
        self._thread: threading.Thread | None = None
        self.committed_records = 0
        self._recheck = False  # after a failed commit, retries look up the transaction version
        self._lock_file = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Commit whatever a previous process left in the spool, then accept records. The spool is
        locked for this process's life (a second gateway on it fails fast) and carries its own
        Delta app id, so gateways with separate spools never skip each other's versions."""
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = (self.spool_dir / ".lock").open("w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise RuntimeError(f"spool {self.spool_dir} is in use by another gateway") from e
        id_file = self.spool_dir / "app_id"
        if not id_file.exists():
            id_file.write_text(f"prodrl-gateway-{uuid.uuid4().hex[:12]}")
        self.app_id = self.app_id or id_file.read_text().strip()
        leftovers = sorted((int(p.stem.split("-")[1]), p) for p in self.spool_dir.glob("seg-*.jsonl"))
        for seq, path in leftovers:
            self._commit(seq, path, check=True)
        last = max(
            [s for s, _ in leftovers]
            + [self.store.transaction_version(t, self.app_id) for t in TABLE_OF.values()]
        )
        with self._cond:
            self._seq = last + 1
            self._open()
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="landing-flusher", daemon=True)
        self._thread.start()
        if leftovers:
            log.info("replayed %d spool segments", len(leftovers))

    def stop(self) -> None:
        """Seal and commit everything; later appends fail."""
        with self._cond:
            if not self._running:
                return
            self._running = False
            self._seal()
            self._file.close()
            Path(self._file.name).unlink()  # the fresh segment _seal opened holds nothing
            self._rows.pop(self._seq, None)
            self._cond.notify_all()
        self._thread.join()
        self._commit_sealed()
        self._lock_file.close()  # releases the spool lock

    # -- writing -----------------------------------------------------------------------------
    def has_room(self) -> bool:
        return self._pending < self.max_pending

    @property
    def pending(self) -> int:
        return self._pending

    def append(self, kind: str, record: dict) -> None:
        """Make `record` durable (spool) and queue it for Delta. Returns once it is on disk."""
        if kind not in TABLE_OF:
            raise ValueError(f"unknown record kind {kind!r}")
        row = pa.Table.from_pylist([record], schema=TABLES[TABLE_OF[kind]])  # refuses what Delta would
        line = json.dumps({"kind": kind, "record": record}, default=json_value, separators=(",", ":"))
        with self._cond:
            if not self._running:
                raise RuntimeError("landing log is stopped")
            try:
                self._file.write(line + "\n")
                self._file.flush()  # in the OS page cache: survives a killed process
                if self.fsync:
                    os.fsync(self._file.fileno())  # survives a lost machine too
            except BaseException:
                self._rows.pop(self._seq, None)  # the file alone says what this segment holds
                raise
            if (held := self._rows.get(self._seq)) is not None:
                held[TABLE_OF[kind]].append(row)
            self._open_count += 1
            self._pending += 1
            if self._open_count >= self.flush_records:
                self._cond.notify_all()

    # -- flushing ----------------------------------------------------------------------------
    def _open(self) -> None:
        self._file = (self.spool_dir / f"seg-{self._seq:012d}.jsonl").open("a", encoding="utf-8")
        self._open_count, self._opened_at = 0, time.monotonic()
        if len(self._rows) < HELD_SEGMENTS:  # decided per segment: all its rows or none are held
            self._rows[self._seq] = defaultdict(list)
        if self.fsync:  # the new segment's directory entry survives a lost machine too
            fd = os.open(self.spool_dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _seal(self) -> None:
        if self._open_count == 0:
            return
        self._file.close()
        self._sealed.append((self._seq, Path(self._file.name)))
        self._seq += 1
        self._open()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._running:
                    return
                self._cond.wait(timeout=self.flush_seconds / 4)
                age = time.monotonic() - self._opened_at
                if self._open_count >= self.flush_records or (self._open_count and age >= self.flush_seconds):
                    self._seal()
            try:
                self._commit_sealed()
                if self.tick:
                    self.tick()
            except Exception:  # keep the spool; the next pass (or restart) commits it
                log.exception("landing commit failed; records stay in the spool")
                self._recheck = True  # a table of the failed segment may have committed already
                time.sleep(self.flush_seconds)

    def _commit_sealed(self) -> None:
        while True:
            with self._cond:
                if not self._sealed:
                    return
                seq, path = self._sealed[0]
            n = self._commit(seq, path, check=self._recheck)
            self._recheck = False
            with self._cond:
                self._sealed.pop(0)
                self._pending -= n

    @staticmethod
    def _read(path: Path) -> dict[str, pa.Table]:
        """A segment's records by table, from its file (one a previous process left)."""
        by_table: dict[str, list[dict]] = defaultdict(list)
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a torn last line: its request was never answered
                    continue
                table = TABLE_OF[entry["kind"]]
                by_table[table].append(from_json(table, entry["record"]))
        return {table: pa.Table.from_pylist(rows, schema=TABLES[table]) for table, rows in by_table.items()}

    def _commit(self, seq: int, path: Path, check: bool = False) -> int:
        """Commit one segment, then delete it; returns its record count. At replay (`check`) a
        segment whose commit already landed is skipped: exactly once. After replay this process is
        the app's only writer and numbers segments past every landed version, so it skips the
        version lookup (a log read per table per commit)."""
        with self._cond:
            held = self._rows.pop(seq, None)
        by_table = (
            {table: pa.concat_tables(rows) for table, rows in held.items()} if held else self._read(path)
        )
        for table in [t for t in TABLE_OF.values() if t in by_table]:  # calls before their feedback
            self.store.append(table, by_table[table], transaction=(self.app_id, seq), check=check)
        path.unlink()
        n = sum(len(r) for r in by_table.values())
        self.committed_records += n
        return n
