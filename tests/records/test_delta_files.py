"""The store's own write path (a pyarrow file committed by deltalake) and its kept snapshots."""

import json
import math
import threading
from datetime import timedelta

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from prodrl_pipeline.records.delta_files import STRING_STATS, commit_version, file_stats
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import DeltaStore
from tests.records.test_store import NOW, _call


def _log(store: DeltaStore, table: str, version: int) -> list[dict]:
    path = store.root + f"/{table}/_delta_log/{version:020d}.json"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _bounds(values: list) -> tuple:
    kept = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return (min(kept), max(kept)) if kept else (None, None)


def test_file_statistics_are_the_rows_own_bounds_rounded_outwards():
    """Brute force over the rows: counts, nulls, min/max of each scalar column and struct field; a
    string minimum is cut to its prefix and a longer maximum left out; timestamps at milliseconds,
    the minimum rounded down and the maximum up; no bounds where NaN or all-null leaves none."""
    long = "z" * (STRING_STATS + 5)
    rows = [
        {
            "i": 5,
            "f": 0.5,
            "nan": float("nan"),
            "s": "b" + long,
            "m": "a",
            "t": NOW + timedelta(microseconds=1500),
        },
        {
            "i": -3,
            "f": None,
            "nan": 1.0,
            "s": "a" + long,
            "m": "a" + long,
            "t": NOW + timedelta(microseconds=2),
        },
        {
            "i": None,
            "f": -2.25,
            "nan": 2.0,
            "s": None,
            "m": "b",
            "t": NOW + timedelta(seconds=1, microseconds=999),
        },
    ]
    schema = pa.schema(
        [
            ("i", pa.int32()),
            ("f", pa.float64()),
            ("nan", pa.float32()),
            ("s", pa.string()),
            ("m", pa.string()),
            ("t", pa.timestamp("us", tz="UTC")),
            ("ids", pa.list_(pa.int32())),
            ("st", pa.struct([("x", pa.int64()), ("none", pa.float64())])),
        ]
    )
    rows = [{**r, "ids": [1, 2], "st": {"x": 10 * k, "none": None}} for k, r in enumerate(rows)]
    stats = file_stats(pa.Table.from_pylist(rows, schema=schema))

    assert stats["numRecords"] == 3
    assert stats["nullCount"] == {
        "i": 1, "f": 1, "nan": 0, "s": 1, "m": 0, "t": 0, "st": {"x": 0, "none": 3}
    }  # fmt: skip
    i, f, s = (_bounds([r[c] for r in rows]) for c in ("i", "f", "s"))
    assert (stats["minValues"]["i"], stats["maxValues"]["i"]) == i == (-3, 5)
    assert (stats["minValues"]["f"], stats["maxValues"]["f"]) == f == (-2.25, 0.5)
    assert "nan" not in stats["minValues"] and "ids" not in stats["minValues"]
    assert stats["minValues"]["s"] == s[0][:STRING_STATS] and "s" not in stats["maxValues"]
    assert (stats["minValues"]["m"], stats["maxValues"]["m"]) == ("a", "b")  # the long one is in between
    assert stats["minValues"]["t"] == "2026-11-30T00:00:00.000Z"  # 2 µs, rounded down
    assert stats["maxValues"]["t"] == "2026-11-30T00:00:01.001Z"  # 1 s 999 µs, rounded up
    assert stats["minValues"]["st"] == {"x": 0} and stats["maxValues"]["st"] == {"x": 20}
    json.dumps(stats, allow_nan=False)  # what the log holds is valid JSON


def test_a_round_is_one_pyarrow_file_that_deltalake_and_datafusion_read_with_its_statistics(tmp_path):
    store = DeltaStore(tmp_path, lineage=True)
    store.overwrite_round("calls", [_call(i, 1, [i], [-1.0]) for i in range(3)], 1)  # created by deltalake
    rows = [{**_call(i, 2, [i, i + 1], [-0.5, -1.0]), "call_index": i} for i in range(5)]
    store.overwrite_round("calls", rows, 2)
    store.overwrite_round("calls", rows[:4], 2)  # replaces the round's file

    actions = _log(store, "calls", 2)
    info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    adds = [a["add"] for a in actions if "add" in a]
    removes = [a["remove"] for a in actions if "remove" in a]
    assert info["operation"] == "WRITE" and info["predicate"] == "round = 2"
    assert "operationMetrics" not in info  # not deltalake's writer: its commits carry metrics
    assert len(adds) == len(removes) == 1 and adds[0]["partitionValues"] == {"round": "2"}
    assert adds[0]["path"].startswith("round=2/") and removes[0]["path"] != adds[0]["path"]
    stats = json.loads(adds[0]["stats"])
    assert stats["numRecords"] == 4 and (
        stats["minValues"]["call_index"],
        stats["maxValues"]["call_index"],
    ) == (0, 3)
    assert store.versions_written["calls"] == {0, 1, 2}

    assert sorted(r["call_id"] for r in store.read("calls", 2).to_pylist()) == ["c0", "c1", "c2", "c3"]
    count = "SELECT count(*) AS n FROM calls WHERE round = 2 AND call_index >= 2"  # prunes on the stats
    assert store.query(count, ["calls"]).to_pylist() == [{"n": 2}]
    assert DeltaTable(store.uri("calls")).to_pyarrow_table().num_rows == 7


def test_an_append_to_an_unpartitioned_table_and_a_write_pyarrow_cannot_take_both_land(tmp_path):
    """Appends of a table without rounds are one file each; an append holding several rounds, an
    empty overwrite, and an overwrite by another predicate go through deltalake's writer."""
    store = DeltaStore(tmp_path)
    fb = {"feedback_id": "f", "trajectory_id": "t", "reward": 1.0, "overwrite": False, "received_at": NOW}
    for i in range(3):
        store.append("landing_feedback", [{**fb, "feedback_id": f"f{i}"}])
    assert [a["add"]["path"].count("/") for a in _log(store, "landing_feedback", 2) if "add" in a] == [0]
    store.append("calls", [_call(0, 1, [1], [-1.0])])
    store.append("calls", [_call(1, 1, [1], [-1.0]), _call(2, 2, [1], [-1.0]), _call(3, None, [1], [-1.0])])
    store.overwrite_round("calls", [], 2)
    reject = {"table_name": "calls", "round": 1, "record_id": "c1", "reason": "x", "rejected_at": NOW}
    store.append("rejects", [reject, {**reject, "table_name": "trajectories"}])
    store.overwrite("rejects", [], "round = 1 AND table_name IN ('calls')")

    assert sorted(r["feedback_id"] for r in store.read("landing_feedback").to_pylist()) == ["f0", "f1", "f2"]
    assert sorted((r["round"] or 0, r["call_id"]) for r in store.read("calls").to_pylist()) == [
        (0, "c3"), (1, "c0"), (1, "c1")
    ]  # fmt: skip
    assert [r["table_name"] for r in store.read("rejects").to_pylist()] == ["trajectories"]


def test_a_kept_snapshot_sees_another_writer_s_commits_and_a_commit_rebased_over_them_is_found(tmp_path):
    ours, theirs = DeltaStore(tmp_path, lineage=True), DeltaStore(tmp_path)
    theirs.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    assert ours.read("calls").num_rows == 1  # kept from here on
    theirs.overwrite_round("calls", [_call(1, 1, [1], [-1.0]), _call(2, 1, [1], [-1.0])], 1)
    theirs.append("calls", [_call(3, 2, [1], [-1.0])])
    assert sorted(r["call_id"] for r in ours.read("calls").to_pylist()) == ["c1", "c2", "c3"]
    assert ours.transaction_version("calls", "app") == -1

    with ours._latest("calls") as stale:  # our snapshot is at 2; they commit 3; ours is rebased to 4
        theirs.append("calls", [_call(4, 3, [1], [-1.0])])
        data = ours._conform("calls", [_call(5, 4, [1], [-1.0])])
        version = ours._commit_file(stale, "calls", data, 4, None, ours._commit(None, ("app", 7)))
    assert version == 4 and DeltaTable(ours.uri("calls")).version() == 4
    assert ours.transaction_version("calls", "app") == 7 and ours.read("calls").num_rows == 5


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
        store.overwrite_round("calls", [_call(1, 2, [1], [-1.0]), _call(2, None, [1], [-1.0])], 2)
    assert store.table("calls").version() == 0 and not (tmp_path / "calls" / "round=2").exists()


def test_the_version_of_a_commit_is_the_one_that_added_its_file_not_a_later_one_removing_it(tmp_path):
    store = DeltaStore(tmp_path)
    for k in range(4):  # version 1 adds round 1's file; version 3 removes it
        store.overwrite_round("calls", [_call(k, 1 + k % 2, [1], [-1.0])], 1 + k % 2)
    added = next(a["add"]["path"] for a in _log(store, "calls", 1) if "add" in a)
    assert any(a.get("remove", {}).get("path") == added for a in _log(store, "calls", 3))
    assert commit_version(str(tmp_path / "calls"), added, 0, 3) == 1
    with pytest.raises(RuntimeError, match="no commit in versions 2..3 adds"):
        commit_version(str(tmp_path / "calls"), added, 1, 3)
