"""The store's own write path (a pyarrow file committed by deltalake) and its kept snapshots."""

import json
import math
import random
import shutil
import threading
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import CommitFailedError

from prodrl_pipeline.records.delta_files import STRING_STATS, _above, commit_version, file_stats
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import DeltaStore, StorageError
from tests.records.test_store import NOW, _call


def _log(store: DeltaStore, table: str, version: int) -> list[dict]:
    path = store.root + f"/{table}/_delta_log/{version:020d}.json"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _bounds(values: list) -> tuple:
    kept = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return (min(kept), max(kept)) if kept else (None, None)


def test_file_statistics_are_the_rows_own_bounds_rounded_outwards():
    """Brute force over the rows: counts, nulls, min/max of each scalar column and struct field (a
    float column with a NaN: its type's widest finite bounds); a long string minimum cut to its
    prefix, a long maximum to a string above it; timestamps at milliseconds, the minimum rounded
    down and the maximum up; no bounds for a column of nulls only."""
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
            ("b", pa.bool_()),
            ("st", pa.struct([("x", pa.int64()), ("none", pa.float64())])),
        ]
    )
    rows = [
        {**r, "ids": [1, 2], "b": [True, None, False][k], "st": {"x": 10 * k, "none": None}}
        for k, r in enumerate(rows)
    ]
    stats = file_stats(pa.Table.from_pylist(rows, schema=schema))

    assert stats["numRecords"] == 3
    assert stats["nullCount"] == {
        "i": 1, "f": 1, "nan": 0, "s": 1, "m": 0, "t": 0, "b": 1, "st": {"x": 0, "none": 3}
    }  # fmt: skip
    i, f, s = (_bounds([r[c] for r in rows]) for c in ("i", "f", "s"))
    assert (stats["minValues"]["i"], stats["maxValues"]["i"]) == i == (-3, 5)
    assert (stats["minValues"]["f"], stats["maxValues"]["f"]) == f == (-2.25, 0.5)
    widest = float(np.finfo(np.float32).max)
    assert (stats["minValues"]["nan"], stats["maxValues"]["nan"]) == (-widest, widest)
    assert "ids" not in stats["minValues"]
    assert (stats["minValues"]["b"], stats["maxValues"]["b"]) == (False, True)
    assert stats["minValues"]["s"] == s[0][:STRING_STATS] and stats["maxValues"]["s"] >= s[1]
    assert len(stats["maxValues"]["s"]) == STRING_STATS
    assert (stats["minValues"]["m"], stats["maxValues"]["m"]) == ("a", "b")  # the long one is in between
    assert stats["minValues"]["t"] == "2026-11-30T00:00:00.000Z"  # 2 µs, rounded down
    assert stats["maxValues"]["t"] == "2026-11-30T00:00:01.001Z"  # 1 s 999 µs, rounded up
    assert stats["minValues"]["st"] == {"x": 0} and stats["maxValues"]["st"] == {
        "x": 20
    }  # "none": nulls only
    json.dumps(stats, allow_nan=False)  # what the log holds is valid JSON


def test_a_long_string_s_upper_bound_is_above_it_and_short():
    """In UTF-8 byte order (the order of code points) and with no surrogate, whatever characters end
    the kept prefix: ASCII, the last before the surrogates, the last code point."""
    rng = random.Random(0)
    alphabet = ["a", "z", "\x7f", "é", "\ud7ff", "\ue000", "\U0010ffff", "😀"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 2 * STRING_STATS)))
        bound = _above(text)
        assert bound.encode() >= text.encode(), (text, bound)
        assert len(bound) <= STRING_STATS or bound == text
        assert not any(0xD800 <= ord(c) <= 0xDFFF for c in bound)
    assert _above("\U0010ffff" * (STRING_STATS + 1)) == "\U0010ffff" * (STRING_STATS + 1)


def test_a_reader_filters_the_files_written_here_by_their_statistics(tmp_path):
    """DataFusion on a table opened outside the store (deltalake's QueryBuilder; not its pyarrow
    dataset, which can abort the interpreter at exit) prunes a file by its bounds: every filter gives
    the rows a scan of them gives."""
    store = DeltaStore(tmp_path)
    row = {"round": 1, "deployment_id": "d", "puzzle_id": "p", "n_calls": 1}
    store.append("eval_results", [{**row, "puzzle_id": "first", "themes": "", "reward": 0.0, "solved": True}])
    rows = [
        {**row, "puzzle_id": "x" * 40, "themes": "b" * 40, "reward": float("nan"), "solved": False},
        {**row, "puzzle_id": "é" * 34, "themes": "a", "reward": 0.5, "solved": True},
    ]
    store.append("eval_results", rows)  # one pyarrow file (checked by the first lines)
    assert (
        "operationMetrics"
        not in next(a for a in _log(store, "eval_results", 1) if "commitInfo" in a)["commitInfo"]
    )
    table = DeltaTable(store.uri("eval_results"))

    def select(where: str = "") -> list[dict]:
        return pa.table(
            QueryBuilder().register("t", table).execute(f"SELECT * FROM t {where}").read_all()
        ).to_pylist()

    every = select()
    for column, op, value, literal in [
        ("themes", ">", "ba", "'ba'"),
        ("puzzle_id", "=", "x" * 40, f"'{'x' * 40}'"),
        ("puzzle_id", ">", "é" * 33, f"'{'é' * 33}'"),
        ("solved", "=", False, "false"),
        ("reward", "=", 0.5, "0.5"),
        ("reward", "<", 0.25, "0.25"),
    ]:
        compare = {"=": lambda a, b: a == b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}[op]
        expected = sorted(r["puzzle_id"] for r in every if compare(r[column], value))
        got = sorted(r["puzzle_id"] for r in select(f"WHERE {column} {op} {literal}"))
        assert got == expected and got, (column, op, value)


def test_datafusion_reads_a_nan_among_equal_values_and_a_zero_s_sign_as_written(tmp_path):
    """DataFusion, filtering on a column whose bounds are equal, reads it as that one value: bounds
    that ignored a NaN (0.5, 0.5) made the NaN 0.5, and zero bounds of one sign (pyarrow's min_max
    of [-0.0, 0.0] is -0.0, -0.0) made 0.0 into -0.0."""
    store = DeltaStore(tmp_path)
    row = {
        "trajectory_id": "t",
        "round": 1,
        "deployment_id": "d",
        "task_id": "x",
        "reward": 0.0,
        "n_calls": 1,
    }
    store.overwrite_round("trajectories", [row], 1)  # created by deltalake; the next write is a file
    rewards = [np.nan, 0.5, 0.5]
    store.overwrite_round(
        "trajectories", [{**row, "trajectory_id": f"t{i}", "reward": r} for i, r in enumerate(rewards)], 1
    )
    store.overwrite_round(
        "trajectories",
        [{**row, "round": 2, "trajectory_id": f"z{i}", "reward": z} for i, z in enumerate([-0.0, 0.0])],
        2,
    )
    read = store.query(
        "SELECT round, reward FROM trajectories WHERE reward IS NOT NULL ORDER BY round", ["trajectories"]
    ).to_pylist()
    assert [math.isnan(r["reward"]) for r in read] == [True, False, False, False, False]
    assert sorted(math.copysign(1.0, r["reward"]) for r in read if r["round"] == 2) == [-1.0, 1.0]


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
    # the count alone would pass without statistics: the filter tests above check them
    count = "SELECT count(*) AS n FROM calls WHERE round = 2 AND call_index >= 2"
    assert store.query(count, ["calls"]).to_pylist() == [{"n": 2}]
    every = QueryBuilder().register("calls", DeltaTable(store.uri("calls"))).execute("SELECT * FROM calls")
    assert pa.table(every.read_all()).num_rows == 7


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


def _write_round(store: DeltaStore, how: str, i: int, k: int) -> None:
    rows = [_call(i, k, [1], [-1.0])]
    store.overwrite_round("calls", rows, k) if how == "overwrite_round" else store.append("calls", rows)


def test_two_writers_of_one_round_conflict_whichever_commits_first(tmp_path, monkeypatch):
    """The other writer commits between our snapshot's refresh and our commit (our refresh is made
    blind to it): an overwrite of a round with no files yet, an overwrite of a round they appended
    to, and an append to a round they overwrote each fail, as deltalake's own writer failed them."""
    import prodrl_pipeline.records.store as store_module

    theirs = DeltaStore(tmp_path)
    theirs.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    newer_commit = store_module.newer_commit
    for k, their_write, our_write in [
        (2, "overwrite_round", "overwrite_round"),
        (3, "append", "overwrite_round"),
        (4, "overwrite_round", "append"),
    ]:
        ours = DeltaStore(tmp_path)
        ours.read("calls")
        stale = ours._snapshots["calls"][0]
        monkeypatch.setattr(store_module, "newer_commit", lambda t, s=stale: t is not s and newer_commit(t))
        _write_round(theirs, their_write, 10 * k, k)
        with pytest.raises(CommitFailedError):
            _write_round(ours, our_write, 10 * k + 1, k)
        assert [r["call_id"] for r in theirs.read("calls", k).to_pylist()] == [f"c{10 * k}"]
    ours.overwrite_round("calls", [_call(99, 2, [1], [-1.0])], 2)  # its snapshot reopened: it lands
    assert [r["call_id"] for r in theirs.read("calls", 2).to_pylist()] == ["c99"]


def test_a_table_partitioned_otherwise_than_the_store_s_is_not_written_by_file(tmp_path):
    from deltalake import write_deltalake

    store = DeltaStore(tmp_path)
    rows = pa.Table.from_pylist([_call(0, 1, [1], [-1.0])], schema=TABLES["calls"])
    write_deltalake(store.uri("calls"), rows)  # no partition column
    with pytest.raises(StorageError, match="partition"):
        store.overwrite_round("calls", [_call(1, 2, [1], [-1.0])], 2)
    assert [r["round"] for r in store.read("calls").to_pylist()] == [1]
    assert not (tmp_path / "calls" / "round=2").exists()


def test_a_table_deleted_and_made_anew_under_a_store_is_read_and_written_as_it_is_now(tmp_path):
    ours, theirs = DeltaStore(tmp_path), DeltaStore(tmp_path)
    for k in (1, 2, 3):
        ours.overwrite_round("calls", [_call(k, k, [1], [-1.0])], k)
    assert ours.read("calls").num_rows == 3  # kept at version 2
    shutil.rmtree(tmp_path / "calls")
    for k in (7, 8, 9, 10):  # versions 0 to 3: past ours, so its next commit file exists
        theirs.overwrite_round("calls", [_call(k, k, [1], [-1.0])], k)
    assert sorted(r["call_id"] for r in ours.read("calls").to_pylist()) == ["c10", "c7", "c8", "c9"]
    ours.overwrite_round("calls", [_call(11, 7, [1], [-1.0])], 7)
    fresh = DeltaStore(tmp_path)
    assert sorted(r["call_id"] for r in fresh.read("calls").to_pylist()) == ["c10", "c11", "c8", "c9"]
    assert fresh.table("calls").version() == 4
