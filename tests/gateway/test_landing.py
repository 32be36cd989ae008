"""The landing log against real Delta tables, with faults injected into the store."""

import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prodrl_pipeline.gateway.landing import HELD_SEGMENTS, LandingLog
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import DeltaStore

NOW = datetime(2026, 11, 30, tzinfo=UTC)


class FlakyStore(DeltaStore):
    """Fails the first append to `fail_table` after the real commit: a commit whose reply was lost."""

    def __init__(self, root, fail_table: str):
        super().__init__(root)
        self.fail_table, self.failed = fail_table, False

    def append(self, table, rows, transaction=None, check=True):
        landed = super().append(table, rows, transaction, check)
        if table == self.fail_table and not self.failed:
            self.failed = True
            raise OSError("connection reset after the commit")
        return landed


def _call(i: int) -> dict:
    return {
        "call_id": f"c{i}",
        "trajectory_id": f"t{i}",
        "call_index": 0,
        "deployment_id": "d",
        "prompt_token_ids": [1],
        "completion_token_ids": [2],
        "completion_logprobs": [-0.1],
        "topk_token_ids": [[2]],
        "topk_logprobs": [[-0.1]],
        "support_size": [9],
        "support_token_ids": [[]],
        "extra_token_ids": [[]],
        "vocab_size": 9,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 1, "seed": 0},
        "finish_reason": "length",
        "messages_json": "[]",
        "created_at": NOW,
    }


def _feedback(i: int) -> dict:
    return {
        "feedback_id": f"f{i}",
        "trajectory_id": f"t{i}",
        "reward": 1.0,
        "comment": None,
        "overwrite": False,
        "received_at": NOW,
    }


def test_a_retried_segment_whose_first_table_committed_is_not_duplicated(tmp_path):
    store = FlakyStore(tmp_path / "tables", fail_table="landing_feedback")
    log = LandingLog(store, tmp_path / "spool", flush_records=10, flush_seconds=0.05)
    log.start()
    log.append("call", _call(1))
    log.append("feedback", _feedback(1))
    log.stop()  # the flusher's commit fails once on feedback (after calls landed); stop retries
    assert store.failed
    assert [r["call_id"] for r in store.read("landing_calls").to_pylist()] == ["c1"]
    assert [r["feedback_id"] for r in store.read("landing_feedback").to_pylist()] == ["f1"]


def test_a_second_gateway_on_the_same_spool_fails_fast_and_records_are_checked_first(tmp_path):
    store = DeltaStore(tmp_path / "tables")
    first = LandingLog(store, tmp_path / "spool")
    first.start()
    with pytest.raises(RuntimeError, match="in use"):
        LandingLog(store, tmp_path / "spool").start()
    with pytest.raises(Exception):  # noqa: B017 - a value Delta would refuse never reaches the spool
        first.append("call", {**_call(2), "sampling": {**_call(2)["sampling"], "top_k": 2**31}})
    first.stop()
    assert store.read("landing_calls").num_rows == 0
    second = LandingLog(store, tmp_path / "spool")
    second.start()  # the lock is released with the first
    assert second.app_id == first.app_id and second.app_id.startswith("prodrl-gateway-")
    second.stop()


def test_with_fsync_each_record_and_each_new_segment_s_directory_entry_reach_the_disk(tmp_path, monkeypatch):
    import os
    import stat

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)) or real(fd))
    log = LandingLog(DeltaStore(tmp_path / "tables"), tmp_path / "spool", fsync=True)
    log.start()
    assert synced == [True]  # the first segment's directory entry
    log.append("call", _call(1))
    assert synced == [True, False]  # the record itself
    log.stop()
    assert True in synced[2:]  # the segment opened when the first was sealed


def _landed_after_an_outage(tmp_path, calls: list[dict]) -> list[dict]:
    """The landed rows (by call id) of `calls` appended one segment each while Delta refuses
    commits: the first HELD_SEGMENTS land from memory, the rest are read back from the spool."""
    store = DeltaStore(tmp_path / "tables")
    log = LandingLog(store, tmp_path / "spool", flush_records=1, flush_seconds=0.05, max_pending=100)
    log.start()
    blocker = tmp_path / "tables" / "landing_calls"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a Delta table: commits fail until this file goes")
    for call in calls:
        log.append("call", call)
    blocker.unlink()
    log.stop()
    return sorted(store.read("landing_calls").to_pylist(), key=lambda r: r["call_id"])


def test_a_backlog_beyond_the_held_segments_is_read_back_and_lands_exactly_as_appended(tmp_path):
    """Segments whose rows are held in memory and segments read back from the spool (a backlog
    while Delta refuses commits) land the same rows, once each."""
    calls = [
        {**_call(i), "sampling": {**_call(i)["sampling"], "logit_bias": [{"token_id": i, "bias": -1.5}]}}
        for i in range(HELD_SEGMENTS + 3)
    ]
    landed = _landed_after_an_outage(tmp_path, calls)
    assert landed == pa.Table.from_pylist(calls, schema=TABLES["landing_calls"]).to_pylist()


def test_a_call_recorded_as_arrays_lands_as_its_lists_do_held_or_read_back(tmp_path):
    """The engine records a position's head and support as arrays (engine/rows.py): a call holding
    them lands the same rows as its lists, from memory and from the spool's JSON."""
    arrays = {
        "topk_token_ids": [np.array([2, 5], dtype=np.int64)],
        "topk_logprobs": [np.array([-0.1, -2.75], dtype=np.float32)],
        "support_size": [3],
        "support_token_ids": [np.array([2, 5, 7], dtype=np.int64)],
        "extra_token_ids": [np.array([], dtype=np.int64)],
    }
    calls = [{**_call(i), **arrays} for i in range(HELD_SEGMENTS + 2)]
    landed = _landed_after_an_outage(tmp_path, calls)
    assert [r["call_id"] for r in landed] == [c["call_id"] for c in calls]
    for row in landed:
        assert row["topk_token_ids"] == [[2, 5]]
        assert row["topk_logprobs"] == [[np.float32(-0.1).item(), -2.75]]  # float32, exact
        assert row["support_token_ids"] == [[2, 5, 7]] and row["extra_token_ids"] == [[]]


def test_steady_traffic_through_a_delta_outage_lands_every_record_once(tmp_path):
    """Segments open while others are held or retried: whatever the flusher's timing, every
    appended record lands exactly once and nothing stays pending."""
    store = DeltaStore(tmp_path / "tables")
    log = LandingLog(store, tmp_path / "spool", flush_records=5, flush_seconds=0.05, max_pending=10**6)
    log.start()
    blocker = tmp_path / "tables" / "landing_calls"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a Delta table: commits fail until this file goes")
    n = 0
    for down in (True, False):  # Delta down, then back, with traffic throughout
        start = time.monotonic()
        while time.monotonic() - start < 0.6:
            log.append("call", _call(n))
            n += 1
            time.sleep(0.005)  # the traffic's pace, not a synchronisation
        if down:
            blocker.unlink()
    log.stop()
    landed = [r["call_id"] for r in store.read("landing_calls").to_pylist()]
    assert sorted(landed) == sorted(f"c{i}" for i in range(n)) and log.pending == 0


REPO = Path(__file__).resolve().parents[2]
CRASHING_GATEWAY = """
import os, signal, sys
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.test_landing import _call, _feedback

log = LandingLog(DeltaStore(sys.argv[1]), sys.argv[2], flush_records=1000, flush_seconds=3600)
log.start()  # nothing is sealed or committed in this process's life: its records stay in the spool
for i in map(int, sys.argv[3:]):
    log.append("call", _call(i))
    log.append("feedback", _feedback(i))
os.kill(os.getpid(), signal.SIGKILL)
"""


def _crash_after_appending(tmp_path, *ids: int) -> list[str]:
    """A gateway process that starts on the spool, appends a call and a feedback per id and is
    killed; returns the segment files it left."""
    command = [sys.executable, "-c", CRASHING_GATEWAY, str(tmp_path / "tables"), str(tmp_path / "spool")]
    done = subprocess.run([*command, *map(str, ids)], cwd=REPO, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    return sorted(p.name for p in (tmp_path / "spool").glob("seg-*.jsonl"))


def test_segments_are_numbered_on_past_every_landed_version_across_restarts_so_replay_loses_nothing(tmp_path):
    """Clean stop, restart, crash, replay, crash, replay: the first segment of a process is the one
    after the highest transaction version on any landing table (or spool segment), so a segment
    left by a crash is never one a table already holds (its replay would be skipped: rows lost)."""
    store = DeltaStore(tmp_path / "tables")

    def landed() -> tuple[list, list]:
        calls = sorted(r["call_id"] for r in store.read("landing_calls").to_pylist())
        return calls, sorted(r["feedback_id"] for r in store.read("landing_feedback").to_pylist())

    first = LandingLog(store, tmp_path / "spool", flush_records=1, flush_seconds=0.05)
    first.start()
    first.append("call", _call(0))  # segment 0: landing_calls at transaction version 0
    deadline = time.monotonic() + 60
    while first.committed_records < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first.append("feedback", _feedback(0))  # segment 1: landing_feedback at version 1, calls still at 0
    first.stop()
    assert landed() == (["c0"], ["f0"]) and not list((tmp_path / "spool").glob("seg-*"))

    # a clean restart numbers on from the highest version of any table: 2, not 1 (feedback holds 1)
    assert _crash_after_appending(tmp_path, 1) == ["seg-000000000002.jsonl"]
    assert landed() == (["c0"], ["f0"])

    third = LandingLog(store, tmp_path / "spool", flush_records=1000, flush_seconds=3600)
    third.start()  # replays segment 2, then numbers on from it
    assert landed() == (["c0", "c1"], ["f0", "f1"])
    third.append("call", _call(2))
    third.stop()  # commits segment 3
    assert landed() == (["c0", "c1", "c2"], ["f0", "f1"])

    assert _crash_after_appending(tmp_path, 3) == ["seg-000000000004.jsonl"]
    last = LandingLog(store, tmp_path / "spool")
    last.start()
    last.stop()
    assert landed() == (["c0", "c1", "c2", "c3"], ["f0", "f1", "f3"])
