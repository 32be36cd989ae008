"""The store's writes (deltalake's writer, every table) against other writers: races, kept snapshots,
threads, tables made anew under it, and values at the edges of what the log's statistics hold."""

import json
import math
import shutil
import threading
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

import prodrl_pipeline.records.store as store_module
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import OVERWRITE_ATTEMPTS, DeltaStore, StorageError
from tests.records.test_store import NOW, _call


def _ids(table: pa.Table) -> list[tuple]:
    return sorted((r["round"] if r["round"] is not None else -1, r["call_id"]) for r in table.to_pylist())


def _foreign(tmp_path, rows: list[dict], mode: str = "append", predicate: str | None = None) -> None:
    """A write by another program: deltalake's own writer, no store, none of its metadata."""
    data = pa.Table.from_pylist(rows, schema=TABLES["calls"])
    write_deltalake(str(tmp_path / "calls"), data, mode=mode, predicate=predicate, partition_by=["round"])


def _racing(monkeypatch, tmp_path, writes: list[tuple]) -> list[int]:
    """Each of the store's next commits is preceded, after its snapshot was read, by the foreign write
    of the same index in `writes` (rows, mode, predicate): a lost race each time. Returns a list
    that counts the store's commit attempts."""
    real, attempts = store_module.write_deltalake, []

    def racing(target, data, **kwargs):  # noqa: ANN001, ANN003
        if len(attempts) < len(writes):
            _foreign(tmp_path, *writes[len(attempts)])
        attempts.append(1)
        return real(target, data, **kwargs)

    monkeypatch.setattr(store_module, "write_deltalake", racing)
    return attempts


def test_an_overwrite_that_loses_a_race_to_a_foreign_append_keeps_none_of_its_rows(tmp_path, monkeypatch):
    """The store read round 1; a foreign `write_deltalake` appends to round 1 and to round 2; the
    store's overwrite of round 1 conflicts, is made again from the new version and lands: round 1 is
    the store's rows only (0 foreign rows kept), round 2's foreign row stays."""
    store = DeltaStore(tmp_path, lineage=True)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    attempts = _racing(monkeypatch, tmp_path, [([_call(90, 1, [1], [-1.0]), _call(91, 2, [1], [-1.0])],)])
    store.overwrite_round("calls", [_call(1, 1, [1], [-1.0]), _call(2, 1, [2], [-1.0])], 1)
    assert len(attempts) == 2  # the first lost
    assert _ids(store.read("calls")) == [(1, "c1"), (1, "c2"), (2, "c91")]
    assert store.versions_written["calls"] == {0, 2}  # version 1 is the foreign append


def test_an_overwrite_racing_a_foreign_overwrite_of_its_round_replaces_it(tmp_path, monkeypatch):
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    _racing(monkeypatch, tmp_path, [([_call(90, 1, [1], [-1.0])], "overwrite", "round = 1")])
    store.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)
    assert _ids(store.read("calls")) == [(1, "c1")]


def test_an_overwrite_that_loses_every_race_raises_and_leaves_the_last_committed_rows(tmp_path, monkeypatch):
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    foreign = [([_call(90 + i, 1, [1], [-1.0])],) for i in range(OVERWRITE_ATTEMPTS)]
    attempts = _racing(monkeypatch, tmp_path, foreign)
    with pytest.raises(CommitFailedError):
        store.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)
    assert len(attempts) == OVERWRITE_ATTEMPTS
    assert _ids(store.read("calls")) == [(1, "c0")] + [(1, f"c{90 + i}") for i in range(OVERWRITE_ATTEMPTS)]


def test_a_kept_snapshot_sees_another_writer_s_commits(tmp_path):
    ours, theirs = DeltaStore(tmp_path, lineage=True), DeltaStore(tmp_path)
    theirs.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    assert ours.read("calls").num_rows == 1  # kept from here on
    theirs.overwrite_round("calls", [_call(1, 1, [1], [-1.0]), _call(2, 1, [1], [-1.0])], 1)
    theirs.append("calls", [_call(3, 2, [1], [-1.0])], transaction=("app", 7))
    assert _ids(ours.read("calls")) == [(1, "c1"), (1, "c2"), (2, "c3")]
    assert ours.transaction_version("calls", "app") == 7
    ours.append("calls", [_call(4, 3, [1], [-1.0])])
    assert ours.versions_written["calls"] == {3} and ours.versions_read["calls"] == {0, 2}


def test_threads_sharing_a_store_lose_no_row_and_each_commit_is_counted_once(tmp_path):
    store = DeltaStore(tmp_path, lineage=True)
    store.append("landing_calls", [])  # the table exists: every thread's append shares its snapshot
    landing = {name: _call(0, 0, [1], [-1.0]).get(name) for name in TABLES["landing_calls"].names}
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(8):
                store.append("landing_calls", [{**landing, "call_id": f"w{w}-{i}"}])
                assert store.read("landing_calls").num_rows >= i + 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(r["call_id"] for r in store.read("landing_calls").to_pylist()) == sorted(
        f"w{w}-{i}" for w in range(4) for i in range(8)
    )
    assert store.versions_written["landing_calls"] == set(range(33))


def test_rows_outside_the_round_overwritten_are_refused_before_anything_is_written(tmp_path):
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    with pytest.raises(ValueError, match="1 rows failed validation.*round 2"):
        store.overwrite_round("calls", [_call(1, 2, [1], [-1.0]), _call(2, 3, [1], [-1.0])], 2)
    assert store.table("calls").version() == 0 and not (tmp_path / "calls" / "round=2").exists()


def test_a_table_partitioned_otherwise_than_the_store_s_is_refused_by_name(tmp_path):
    store = DeltaStore(tmp_path)
    rows = pa.Table.from_pylist([_call(0, 1, [1], [-1.0])], schema=TABLES["calls"])
    write_deltalake(store.uri("calls"), rows)  # no partition column
    with pytest.raises(StorageError, match="table 'calls'.*partition"):
        store.overwrite_round("calls", [_call(1, 2, [1], [-1.0])], 2)
    assert [r["round"] for r in store.read("calls").to_pylist()] == [1]


def test_a_table_deleted_and_made_anew_under_a_store_is_read_and_written_as_it_is_now(tmp_path):
    ours, theirs = DeltaStore(tmp_path), DeltaStore(tmp_path)
    for k in (1, 2, 3):
        ours.overwrite_round("calls", [_call(k, k, [1], [-1.0])], k)
    assert ours.read("calls").num_rows == 3  # kept at version 2
    shutil.rmtree(tmp_path / "calls")
    for k in (7, 8, 9, 10):  # versions 0 to 3: past ours
        theirs.overwrite_round("calls", [_call(k, k, [1], [-1.0])], k)
    assert sorted(r["call_id"] for r in ours.read("calls").to_pylist()) == ["c10", "c7", "c8", "c9"]
    ours.overwrite_round("calls", [_call(11, 7, [1], [-1.0])], 7)
    fresh = DeltaStore(tmp_path)
    assert sorted(r["call_id"] for r in fresh.read("calls").to_pylist()) == ["c10", "c11", "c8", "c9"]
    assert fresh.table("calls").version() == 4


def test_an_append_only_table_refuses_a_round_overwrite_and_takes_appends(tmp_path):
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    DeltaTable(store.uri("calls")).alter.set_table_properties({"delta.appendOnly": "true"})
    with pytest.raises(CommitFailedError, match="append-only"):
        store.overwrite_round("calls", [_call(2, 1, [1], [-1.0])], 1)
    store.append("calls", [_call(3, 2, [1], [-1.0])])
    assert _ids(store.read("calls")) == [(1, "c0"), (2, "c3")]


def test_commit_metadata_may_not_set_the_fields_a_reader_parses(tmp_path):
    """A `timestamp` string in commitInfo would make the table's history unreadable."""
    for field in ("timestamp", "inCommitTimestamp", "operation"):
        with pytest.raises(ValueError, match=field):
            DeltaStore(tmp_path, commit_metadata={field: "2026-01-01"})
    store = DeltaStore(tmp_path, commit_metadata={"run": "r"})
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    store.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)
    assert [h["run"] for h in DeltaTable(store.uri("calls")).history()] == ["r", "r"]


@pytest.mark.parametrize(
    "when",
    [
        datetime(999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
    ],
)
def test_timestamps_at_the_ends_of_the_calendar_are_written_with_bounds_a_reader_parses(tmp_path, when):
    """A file's bounds are what a filtered read prunes by: a year before 1000 written unpadded is a
    bound deltalake cannot parse (a filtered read found 0 of 3 rows); the year 9999 must not overflow."""
    store = DeltaStore(tmp_path)
    fb = {"trajectory_id": "t", "reward": 1.0, "overwrite": False}
    store.append("landing_feedback", [{**fb, "feedback_id": "dawn", "received_at": NOW}])
    store.append(
        "landing_feedback", [{**fb, "feedback_id": f"edge{i}", "received_at": when} for i in range(3)]
    )
    adds = [
        json.loads(line)["add"] for line in _log_lines(tmp_path / "landing_feedback", 1) if '"add"' in line
    ]
    bound = json.loads(adds[0]["stats"])["minValues"]["received_at"]
    assert bound.startswith(when.strftime("%Y").zfill(4) + "-")
    got = store.query(
        "SELECT feedback_id, received_at FROM landing_feedback WHERE feedback_id >= 'edge1'",
        ["landing_feedback"],
    ).to_pylist()
    assert sorted(r["feedback_id"] for r in got) == ["edge1", "edge2"] and {
        r["received_at"] for r in got
    } == {when}
    stored = [r["received_at"] for r in store.read("landing_feedback").to_pylist()]
    assert sorted(stored) == sorted([when] * 3 + [NOW])


def test_a_zero_s_sign_is_read_as_written(tmp_path):
    """Zero bounds of one sign (a min-max of [-0.0, 0.0] as -0.0, -0.0) would make 0.0 into -0.0 under
    a filter. (A NaN among equal values is read as that value under a filter on it, by deltalake's
    bounds: no table holds a NaN, validation refuses one.)"""
    store = DeltaStore(tmp_path)
    row = {"trajectory_id": "t", "deployment_id": "d", "task_id": "x", "n_calls": 1, "round": 2}
    zeros = [{**row, "trajectory_id": f"z{i}", "reward": z} for i, z in enumerate([-0.0, 0.0])]
    store.overwrite_round("trajectories", zeros, 2)
    read = store.query("SELECT reward FROM trajectories WHERE reward = 0.0", ["trajectories"]).to_pylist()
    assert sorted(math.copysign(1.0, r["reward"]) for r in read) == [-1.0, 1.0]


def _log_lines(folder, version: int) -> list[str]:
    return (folder / "_delta_log" / f"{version:020d}.json").read_text(encoding="utf-8").splitlines()


def test_an_overwrite_other_than_a_whole_round_is_not_made_again_after_a_lost_race(tmp_path, monkeypatch):
    """Its rows may come from a read the race made stale (the registry reads live, then overwrites a
    row): the lost race is raised, naming the table, after one attempt."""
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    attempts = _racing(monkeypatch, tmp_path, [([_call(0, 1, [2], [-1.0])],)])
    with pytest.raises(CommitFailedError, match="table 'calls': the overwrite of call_id = 'c0'"):
        store.overwrite("calls", [_call(0, 1, [3], [-1.0])], "call_id = 'c0'")
    assert len(attempts) == 1


def test_a_table_another_writer_creates_during_the_first_write_keeps_its_rows(tmp_path, monkeypatch):
    """The store found no table; another writer makes it (rounds 1 and 2) before the store's first
    commit: the store's round 3 lands beside them, not over them (an overwrite creating the table
    would replace it whole)."""
    ours = DeltaStore(tmp_path, lineage=True)
    _racing(monkeypatch, tmp_path, [([_call(1, 1, [1], [-1.0]), _call(2, 2, [1], [-1.0])], "overwrite")])
    ours.overwrite_round("calls", [_call(3, 3, [1], [-1.0])], 3)
    assert _ids(ours.read("calls")) == [(1, "c1"), (2, "c2"), (3, "c3")]
    ours.overwrite_round("calls", [_call(4, 3, [1], [-1.0])], 3)
    assert _ids(DeltaStore(tmp_path).read("calls")) == [(1, "c1"), (2, "c2"), (3, "c4")]


def test_a_local_snapshot_is_caught_up_only_when_another_commit_exists(tmp_path, monkeypatch):
    """The gateway appends a batch a commit: after its own commit the kept snapshot is current, and
    asking deltalake to catch up costs ~0.5 ms a use; a foreign commit is still seen."""
    ours, theirs = DeltaStore(tmp_path), DeltaStore(tmp_path)
    ours.append("calls", [_call(0, 1, [1], [-1.0])])
    catch_ups = []
    real = DeltaTable.update_incremental
    monkeypatch.setattr(DeltaTable, "update_incremental", lambda dt: (catch_ups.append(1), real(dt))[1])
    ours.append("calls", [_call(1, 1, [1], [-1.0])])
    assert ours.read("calls").num_rows == 2 and not catch_ups
    theirs.append("calls", [_call(2, 1, [1], [-1.0])])
    assert ours.read("calls").num_rows == 3 and len(catch_ups) == 1
