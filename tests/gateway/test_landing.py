"""The landing log against real Delta tables, with faults injected into the store."""

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prodrl_pipeline.gateway.landing import HELD_SEGMENTS, LandingLog
from prodrl_pipeline.records import support
from prodrl_pipeline.records.schema import TABLES, json_value
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
    while Delta refuses commits) land the same rows, once each, trajectory ids of any text included."""
    calls = [
        {
            **_call(i),
            "trajectory_id": f"ü {i}@example.com\r\n\"'; --",
            "sampling": {**_call(i)["sampling"], "logit_bias": [{"token_id": i, "bias": -1.5}]},
        }
        for i in range(HELD_SEGMENTS + 3)
    ]
    landed = _landed_after_an_outage(tmp_path, calls)
    assert landed == pa.Table.from_pylist(calls, schema=TABLES["landing_calls"]).to_pylist()


def test_a_call_recorded_as_arrays_lands_as_its_lists_do_held_or_read_back(tmp_path):
    """The engine records a position's head and support as arrays and bytes (engine/rows.py,
    records/support.py): a call holding them lands the same rows as its lists, from memory and from
    the spool's JSON (where a bitmask is base64)."""
    arrays = {
        "topk_token_ids": [np.array([2, 5], dtype=np.int64)],
        "topk_logprobs": [np.array([-0.1, -2.75], dtype=np.float32)],
        **support.columns([support.from_ids([2, 5, 7], 2, 9)]),  # 2 bytes, not 3 ids
        "extra_token_ids": [np.array([], dtype=np.int64)],
    }
    assert arrays["support_form"] == [support.Form.BITMASK]
    calls = [{**_call(i), **arrays} for i in range(HELD_SEGMENTS + 2)]
    landed = _landed_after_an_outage(tmp_path, calls)
    assert [r["call_id"] for r in landed] == [c["call_id"] for c in calls]
    for row in landed:
        assert row["topk_token_ids"] == [[2, 5]]
        assert row["topk_logprobs"] == [[np.float32(-0.1).item(), -2.75]]  # float32, exact
        assert row["support_mask"] == [b"\xa4\x00"] and row["support_token_ids"] == [[]]  # bits 2, 5, 7
        assert row["extra_token_ids"] == [[]]


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
CHILD_GATEWAY = """
import os, signal, sys
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.test_landing import _call, _feedback

log = LandingLog(DeltaStore(sys.argv[1]), sys.argv[2], flush_records=1000, flush_seconds=3600)
log.start()  # nothing is sealed or committed in this process's life: its records stay in the spool
for i in map(int, sys.argv[4:]):
    log.append("call", _call(i))
    log.append("feedback", _feedback(i))
if sys.argv[3] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
# else the interpreter exits with the log never stopped: its flusher must not keep it alive
"""


def _child_appending(tmp_path, end: str, *ids: int) -> list[str]:
    """A gateway process that starts on the spool, appends a call and a feedback per id, and is
    killed (`end` "kill") or returns without stopping the log ("exit"); the segment files left."""
    command = [sys.executable, "-c", CHILD_GATEWAY, str(tmp_path / "tables"), str(tmp_path / "spool"), end]
    done = subprocess.run([*command, *map(str, ids)], cwd=REPO, capture_output=True, timeout=120)
    assert done.returncode == (-signal.SIGKILL if end == "kill" else 0), done.stderr.decode()
    return sorted(p.name for p in (tmp_path / "spool").glob("seg-*.jsonl"))


def _crash_after_appending(tmp_path, *ids: int) -> list[str]:
    return _child_appending(tmp_path, "kill", *ids)


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


def _wait_until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _block_calls(tmp_path) -> Path:
    """Delta refuses landing_calls commits until the returned file is removed."""
    blocker = tmp_path / "tables" / "landing_calls"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a Delta table: commits fail until this file goes")
    return blocker


def test_settings_are_checked_at_their_bounds_and_default_to_the_documented_values(tmp_path):
    store = DeltaStore(tmp_path / "tables")
    message = "need flush_records >= 1, flush_seconds > 0 and max_pending >= flush_records"
    for records, seconds, pending in ((0, 1.0, 10), (1, 0.0, 10), (1, -1.0, 10), (5, 1.0, 4), (0, 0.0, 0)):
        with pytest.raises(ValueError) as refused:
            LandingLog(
                store, tmp_path / "spool", flush_records=records, flush_seconds=seconds, max_pending=pending
            )
        assert str(refused.value) == message
    edge = LandingLog(store, tmp_path / "spool", flush_records=1, flush_seconds=1e-9, max_pending=1)
    assert (edge.flush_records, edge.flush_seconds, edge.max_pending) == (1, 1e-9, 1)
    plain = LandingLog(store, tmp_path / "spool")
    assert (plain.flush_records, plain.flush_seconds, plain.max_pending, plain.fsync) == (
        256,
        1.0,
        10_000,
        False,
    )


def test_appends_outside_start_and_stop_are_refused_and_a_stop_before_start_does_nothing(tmp_path):
    log = LandingLog(DeltaStore(tmp_path / "tables"), tmp_path / "spool")
    log.stop()  # nothing to stop
    with pytest.raises(RuntimeError, match=r"^landing log is stopped$"):
        log.append("call", _call(1))
    log.start()
    with pytest.raises(ValueError, match=r"^unknown record kind 'bogus'$"):
        log.append("bogus", _call(1))
    log.stop()
    with pytest.raises(RuntimeError, match=r"^landing log is stopped$"):
        log.append("call", _call(2))
    assert log.committed_records == 0 and not list((tmp_path / "spool").glob("seg-*"))


def test_a_segment_is_sealed_at_flush_records_and_the_committed_count_adds_up(tmp_path):
    log = LandingLog(DeltaStore(tmp_path / "tables"), tmp_path / "spool", flush_records=3, flush_seconds=3600)
    log.start()
    for i in range(2):
        log.append("call", _call(i))
    time.sleep(0.5)  # the flusher has had its chance: two records are below flush_records
    assert log.committed_records == 0 and log.pending == 2
    log.append("call", _call(2))  # the third seals the segment
    _wait_until(lambda: log.committed_records == 3)
    for i in range(3, 6):
        log.append("call", _call(i))
    _wait_until(lambda: log.committed_records == 6)
    assert log.pending == 0
    log.stop()


def test_a_segment_is_sealed_once_it_is_flush_seconds_old_not_before(tmp_path):
    log = LandingLog(
        DeltaStore(tmp_path / "tables"), tmp_path / "spool", flush_records=1000, flush_seconds=3.0
    )
    log.start()
    log.append("call", _call(1))
    time.sleep(1.2)  # the flusher woke at least once (every flush_seconds / 4): too young to seal
    assert log.committed_records == 0
    _wait_until(lambda: log.committed_records == 1)  # without a stop: by its age alone
    log.stop()


def test_after_an_outage_the_flusher_commits_without_a_stop_and_logs_why_it_waited(tmp_path, caplog):
    log = LandingLog(
        DeltaStore(tmp_path / "tables"),
        tmp_path / "spool",
        flush_records=1,
        flush_seconds=0.05,
        max_pending=2,
    )
    log.start()
    blocker = _block_calls(tmp_path)
    log.append("call", _call(1))
    assert log.has_room()  # 1 pending of at most 2
    log.append("call", _call(2))
    assert not log.has_room() and log.pending == 2  # at max_pending: the server answers 503
    _wait_until(lambda: "landing commit failed; records stay in the spool" in caplog.messages)
    blocker.unlink()
    _wait_until(lambda: log.committed_records == 2)  # the flusher retried on its own
    assert log.has_room() and log.pending == 0
    log.stop()
    assert sorted(r["call_id"] for r in log.store.read("landing_calls").to_pylist()) == ["c1", "c2"]


def test_stopping_with_more_segments_waiting_than_are_held_in_memory_lands_them_all(tmp_path):
    """Segments opened while HELD_SEGMENTS others wait are not held: stop closes the last of them."""
    log = LandingLog(DeltaStore(tmp_path / "tables"), tmp_path / "spool", flush_records=1, flush_seconds=0.05)
    log.start()
    blocker = _block_calls(tmp_path)
    n = HELD_SEGMENTS + 1
    for i in range(n):
        log.append("call", _call(i))
        _wait_until(lambda i=i: len(list((tmp_path / "spool").glob("seg-*.jsonl"))) == i + 2)  # sealed
    blocker.unlink()
    log.stop()
    assert sorted(r["call_id"] for r in log.store.read("landing_calls").to_pylist()) == [
        f"c{i}" for i in range(n)
    ]


def test_a_replayed_segment_whose_commit_already_landed_is_not_committed_again(tmp_path, caplog):
    """A process that died after a segment's commit and before deleting its file: the replay finds
    the transaction version and skips it."""
    assert _crash_after_appending(tmp_path, 7) == ["seg-000000000000.jsonl"]
    left = (tmp_path / "spool" / "seg-000000000000.jsonl").read_bytes()
    store = DeltaStore(tmp_path / "tables")
    log = LandingLog(store, tmp_path / "spool")
    with caplog.at_level(logging.INFO, logger="prodrl_pipeline.gateway.landing"):
        log.start()  # commits it, deletes it
    assert "replayed 1 spool segments" in caplog.messages
    log.stop()
    (tmp_path / "spool" / "seg-000000000000.jsonl").write_bytes(left)  # as if never deleted
    again = LandingLog(store, tmp_path / "spool")
    again.start()
    again.stop()
    assert [r["call_id"] for r in store.read("landing_calls").to_pylist()] == ["c7"]
    assert [r["feedback_id"] for r in store.read("landing_feedback").to_pylist()] == ["f7"]
    assert not list((tmp_path / "spool").glob("seg-*"))


class CountingStore(DeltaStore):
    """Counts transaction version lookups (each a read of the table's log)."""

    lookups = 0

    def transaction_version(self, table, app_id):
        self.lookups += 1
        return super().transaction_version(table, app_id)


def test_after_its_replay_a_process_commits_without_looking_up_transaction_versions(tmp_path):
    store = CountingStore(tmp_path / "tables")
    log = LandingLog(store, tmp_path / "spool", flush_records=1, flush_seconds=0.05)
    log.start()
    assert store.lookups == 3  # one per landing table, to number the first segment
    for i in range(3):
        log.append("call", _call(i))
        _wait_until(lambda i=i: log.committed_records == i + 1)
    log.stop()
    assert store.lookups == 3 and store.read("landing_calls").num_rows == 3


def test_the_spool_folder_its_app_id_file_and_the_flusher_thread(tmp_path):
    spool = tmp_path / "a" / "b" / "spool"  # made with its parents
    log = LandingLog(DeltaStore(tmp_path / "tables"), spool)
    log.start()
    assert re.fullmatch(r"prodrl-gateway-[0-9a-f]{12}", log.app_id)
    assert (spool / "app_id").read_text() == log.app_id
    assert [t.daemon for t in threading.enumerate() if t.name == "landing-flusher"] == [True]
    log.stop()
    (spool / "app_id").write_text("prodrl-gateway-0123456789ab\n")  # an older gateway's spool
    log = LandingLog(DeltaStore(tmp_path / "tables"), spool)
    log.start()
    assert log.app_id == "prodrl-gateway-0123456789ab"
    log.stop()
    given = LandingLog(DeltaStore(tmp_path / "tables"), spool, app_id="mine")
    given.start()
    assert given.app_id == "mine"
    given.stop()


def test_a_process_that_exits_without_stopping_the_log_exits_and_leaves_its_records_in_the_spool(tmp_path):
    assert _child_appending(tmp_path, "exit", 1) == ["seg-000000000000.jsonl"]
    log = LandingLog(DeltaStore(tmp_path / "tables"), tmp_path / "spool")
    log.start()
    log.stop()
    assert [r["call_id"] for r in log.store.read("landing_calls").to_pylist()] == ["c1"]


def test_a_torn_line_inside_a_segment_is_skipped_and_the_lines_after_it_land(tmp_path):
    """A write that failed half-way (no space) leaves a torn line, and later appends follow it."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "app_id").write_text("prodrl-gateway-0123456789ab")
    lines = [json.dumps({"kind": "call", "record": _call(i)}, default=json_value) for i in range(3)]
    torn = lines[1][: len(lines[1]) // 2]
    (spool / "seg-000000000000.jsonl").write_text(f"{lines[0]}\n{torn}\n{lines[2]}\n", encoding="utf-8")
    log = LandingLog(DeltaStore(tmp_path / "tables"), spool)
    log.start()
    log.stop()
    assert sorted(r["call_id"] for r in log.store.read("landing_calls").to_pylist()) == ["c0", "c2"]


@pytest.mark.parametrize("held", [HELD_SEGMENTS, 0], ids=["held", "none-held"])
def test_a_record_whose_fsync_failed_lands_as_its_spool_file_says(tmp_path, monkeypatch, held):
    """The record reached the file (written, flushed) but its fsync failed: the append raises that
    error, and the segment is then committed from its file, as a replay after a crash would, not
    from memory; so also when the segment was not held in memory (a backlog)."""
    import os
    import stat

    import prodrl_pipeline.gateway.landing as landing

    monkeypatch.setattr(landing, "HELD_SEGMENTS", held)

    real, failed = os.fsync, []

    def fsync(fd):
        if not failed and not stat.S_ISDIR(os.fstat(fd).st_mode):  # the first record's, not a folder's
            failed.append(fd)
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    log = LandingLog(DeltaStore(tmp_path / "tables"), tmp_path / "spool", fsync=True, flush_seconds=3600)
    log.start()
    with pytest.raises(OSError, match="No space left"):
        log.append("call", _call(1))
    log.append("call", _call(2))
    log.stop()
    assert failed and sorted(r["call_id"] for r in log.store.read("landing_calls").to_pylist()) == [
        "c1",
        "c2",
    ]


def test_a_record_without_its_optional_fields_lands_the_same_held_or_read_back(tmp_path):
    """`append` takes a record that leaves out nullable fields (they are null); a segment read back
    from the spool (a backlog, a replay) must land it as the rows held in memory do."""
    bare = {k: v for k, v in _feedback(1).items() if k != "comment"}
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "app_id").write_text("prodrl-gateway-0123456789ab")
    line = json.dumps({"kind": "feedback", "record": bare}, default=json_value)
    (spool / "seg-000000000000.jsonl").write_text(line + "\n", encoding="utf-8")
    store = DeltaStore(tmp_path / "tables")
    log = LandingLog(store, spool)
    log.start()  # the segment is read back from its file
    log.append("feedback", {**bare, "feedback_id": "f2"})  # held in memory
    log.stop()
    rows = sorted(store.read("landing_feedback").to_pylist(), key=lambda r: r["feedback_id"])
    assert rows == [{**_feedback(1), "feedback_id": f} for f in ("f1", "f2")]
