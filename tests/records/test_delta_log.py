"""The store's own commits (`records/delta_log.py`): what deltalake and a fresh reader make of them,
the files they leave (`LiveFiles`), and a version another writer took first."""

import os

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import CommitFailedError

from prodrl_pipeline.records.store import CHECKPOINT_INTERVAL, DeltaStore
from tests.records.test_delta_files import _log
from tests.records.test_store import _call


def _ids(table: pa.Table) -> list[tuple]:
    """(round, call id) of each row, in call-id order (a null round sorts with the rest)."""
    return sorted(((r["round"], r["call_id"]) for r in table.to_pylist()), key=lambda row: row[1])


def _deltalake_rows(store: DeltaStore, table: str) -> pa.Table:
    """The table as a fresh deltalake snapshot reads it (DataFusion), not through the store."""
    dt = DeltaTable(store.uri(table))
    return pa.table(QueryBuilder().register("t", dt).execute("SELECT * FROM t").read_all())


def test_own_commits_are_read_by_deltalake_as_the_store_reads_them(tmp_path):
    store = DeltaStore(tmp_path, commit_metadata={"run": "r1"}, lineage=True)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)  # version 0: deltalake's writer
    store.overwrite_round("calls", [_call(1, 1, [1], [-1.0]), _call(2, 1, [1], [-1.0])], 1)
    store.append("calls", [_call(3, 2, [1], [-1.0])], transaction=("app", 5))
    store.overwrite_round("calls", [_call(4, 2, [1], [-1.0])], 2)  # replaces the appended round 2
    store.append("calls", [_call(5, None, [1], [-1.0])])  # a null round

    expected = [(1, "c1"), (1, "c2"), (2, "c4"), (None, "c5")]
    assert _ids(store.read("calls")) == _ids(_deltalake_rows(store, "calls")) == expected
    assert [r["call_id"] for r in store.read("calls", 2).to_pylist()] == ["c4"]
    fresh = DeltaTable(store.uri("calls"))
    assert fresh.version() == 4 and store.versions_written["calls"] == {0, 1, 2, 3, 4}
    assert fresh.transaction_version("app") == 5 and fresh.transaction_version("prodrl.round=2") == 2
    last = fresh.history(1)[0]
    assert last["operation"] == "WRITE" and last["run"] == "r1"
    assert last["operationParameters"]["mode"] == "Append"
    removed = [a["remove"]["path"] for a in _log(store, "calls", 3) if "remove" in a]
    added_2 = [a["add"]["path"] for a in _log(store, "calls", 2) if "add" in a]
    assert removed == added_2  # the overwrite of round 2 removed exactly round 2's file
    assert not [n for n in os.listdir(tmp_path / "calls" / "_delta_log") if n.endswith(".tmp")]


def test_reads_between_deltalake_catch_ups_see_every_own_commit_and_a_checkpoint_catches_up(tmp_path):
    store, other = DeltaStore(tmp_path), DeltaStore(tmp_path)
    store.append("landing_calls", [])  # the table exists
    landing = {name: _call(0, 0, [1], [-1.0]).get(name) for name in store.read("landing_calls").schema.names}
    for i in range(2 * CHECKPOINT_INTERVAL + 3):
        store.append("landing_calls", [{**landing, "call_id": f"l{i}"}])
        assert store.read("landing_calls").num_rows == i + 1
        assert other.read("landing_calls").num_rows == i + 1  # another store, its own snapshot
    log = tmp_path / "landing_calls" / "_delta_log"
    assert {f"{v:020d}.checkpoint.parquet" for v in (10, 20)} <= set(os.listdir(log))
    assert DeltaTable(store.uri("landing_calls")).version() == 2 * CHECKPOINT_INTERVAL + 3
    # the checkpoint at 20 caught deltalake's snapshot up; the three own commits after it are live
    assert store._snapshots["landing_calls"][0].version() == 2 * CHECKPOINT_INTERVAL
    assert store._live["landing_calls"].version == 2 * CHECKPOINT_INTERVAL + 3


def test_a_version_another_writer_took_is_committed_by_deltalake_from_the_version_read(tmp_path):
    """Ours is ahead of its deltalake snapshot by two own commits when theirs takes the next
    version: ours commits through deltalake from its own version (a rebase over theirs, not a
    conflict with its own commits), and both writes are in the table."""
    ours, theirs = DeltaStore(tmp_path, lineage=True), DeltaStore(tmp_path)
    ours.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    ours.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)
    ours.overwrite_round("calls", [_call(2, 1, [1], [-1.0])], 1)
    with ours._latest("calls", own=True) as stale:
        assert stale.version() == 0 and ours._live["calls"].version == 2  # behind only its own
        theirs.append("calls", [_call(3, 2, [1], [-1.0])])  # version 3
        data = ours._conform("calls", [_call(4, 1, [1], [-1.0])])
        commit = ours._commit({"predicate": "round = 1"}, None, [1], ours._live["calls"].version)
        version = ours._commit_file(stale, "calls", data, 1, "round = 1", commit)
    assert version == 4 and DeltaTable(ours.uri("calls")).version() == 4
    assert [r["call_id"] for r in ours.read("calls", 1).to_pylist()] == ["c4"]
    assert [r["call_id"] for r in ours.read("calls", 2).to_pylist()] == ["c3"]
    assert _ids(_deltalake_rows(ours, "calls")) == [(2, "c3"), (1, "c4")]


def test_a_round_another_writer_overwrote_first_conflicts_though_ours_is_ahead_of_its_snapshot(tmp_path):
    """The round guard holds on the fallback: deltalake sees theirs (not ours) as concurrent."""
    ours, theirs = DeltaStore(tmp_path), DeltaStore(tmp_path)
    ours.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    ours.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)  # ours ahead of its snapshot
    with ours._latest("calls", own=True) as stale:
        theirs.overwrite_round("calls", [_call(2, 1, [1], [-1.0])], 1)  # takes version 2
        data = ours._conform("calls", [_call(3, 1, [1], [-1.0])])
        commit = ours._commit({"predicate": "round = 1"}, None, [1], ours._live["calls"].version)
        with pytest.raises(CommitFailedError):
            ours._commit_file(stale, "calls", data, 1, "round = 1", commit)
    assert [r["call_id"] for r in theirs.read("calls", 1).to_pylist()] == ["c2"]
    assert DeltaTable(ours.uri("calls")).version() == 2


def test_an_append_only_table_refuses_a_round_overwrite_as_deltalake_does(tmp_path):
    """The store's own commit would write the removes deltalake refuses on `delta.appendOnly`."""
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    store.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)  # ours ahead of its snapshot
    DeltaTable(store.uri("calls")).alter.set_table_properties({"delta.appendOnly": "true"})
    with pytest.raises(CommitFailedError, match="append-only"):
        store.overwrite_round("calls", [_call(2, 1, [1], [-1.0])], 1)
    store.append("calls", [_call(3, 2, [1], [-1.0])])  # appends still land
    assert _ids(store.read("calls")) == [(1, "c1"), (2, "c3")]


def test_commit_metadata_may_not_set_the_fields_a_reader_parses(tmp_path):
    """A `timestamp` string in commitInfo would make the table's history unreadable."""
    for field in ("timestamp", "inCommitTimestamp"):
        with pytest.raises(ValueError, match=field):
            DeltaStore(tmp_path, commit_metadata={field: "2026-01-01"})
    store = DeltaStore(tmp_path, commit_metadata={"run": "r"})
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    store.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)  # the store's own commit
    assert [h["run"] for h in DeltaTable(store.uri("calls")).history()] == ["r", "r"]


def test_the_round_guard_refuses_an_overwrite_racing_an_append_to_its_round(tmp_path):
    """Theirs is ahead of its snapshot by an own commit when ours appends to round 1: theirs'
    overwrite of round 1 falls back to deltalake from the version it read, and only the round's app
    transaction makes it conflict (nothing it read was removed)."""
    ours, theirs = DeltaStore(tmp_path), DeltaStore(tmp_path)
    ours.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    theirs.append("calls", [_call(1, 2, [1], [-1.0])])  # theirs: an own commit, live ahead
    with theirs._latest("calls", own=True) as stale:
        ours.append("calls", [_call(2, 1, [1], [-1.0])])  # takes the next version
        data = theirs._conform("calls", [_call(3, 1, [1], [-1.0])])
        commit = theirs._commit({"predicate": "round = 1"}, None, [1], theirs._live["calls"].version)
        with pytest.raises(CommitFailedError):
            theirs._commit_file(stale, "calls", data, 1, "round = 1", commit)
    assert _ids(_deltalake_rows(ours, "calls")) == [(1, "c0"), (2, "c1"), (1, "c2")]


def test_a_commit_whose_temporary_file_cannot_be_removed_is_still_a_written_version(tmp_path, monkeypatch):
    """The link landed: the write is reported as done (its version in the lineage), not as failed."""
    store = DeltaStore(tmp_path, lineage=True)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    real_remove = os.remove

    def refuse_temporary(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if str(path).endswith(".json.tmp"):
            raise PermissionError(path)
        return real_remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refuse_temporary)
    store.append("calls", [_call(1, 2, [1], [-1.0])])
    assert store.versions_written["calls"] == {0, 1}
    assert _ids(_deltalake_rows(store, "calls")) == [(1, "c0"), (2, "c1")]
