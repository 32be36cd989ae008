"""The registry's live pointer (compare-and-set over the deployments table), its maintenance, its
lineage and its error messages, pinned by what a caller reads: exact messages, counts, versions,
commit metadata and the files left on disk."""

from datetime import UTC, datetime

import pytest

from prodrl_pipeline.records.registry import live_deployment, move_live, set_live
from prodrl_pipeline.records.store import DeltaStore, StorageError
from tests.records.test_store import _register, _reject

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def test_moving_live_answers_whether_it_moved_and_its_commit_carries_the_metadata(tmp_path):
    store = DeltaStore(tmp_path, commit_metadata={"dagster_run_id": "run-7"}, lineage=True)
    _register(store, "base", "r1")
    assert move_live(store, "base", lambda live: live is None) is True
    assert move_live(store, "r1", lambda live: live is None) is False  # base is live now
    assert live_deployment(store)["deployment_id"] == "base"
    version = store.table("deployments").version()
    assert store.versions_written["deployments"] == {0, 1, version}  # two registrations, one move
    last = store.table("deployments").history(1)[0]
    assert (last["live"], last["dagster_run_id"]) == ("base", "run-7")


def test_a_registry_that_keeps_changing_is_tried_five_times_then_named_in_the_error(tmp_path):
    store, other = DeltaStore(tmp_path), DeltaStore(tmp_path)
    _register(store, "base", "r1")
    tries = []

    def another_writer_moves_first(live) -> bool:
        tries.append(live)
        set_live(other, "base" if len(tries) % 2 else "r1")  # every decision is made stale
        return True

    with pytest.raises(RuntimeError) as failed:
        move_live(store, "r1", another_writer_moves_first)
    assert str(failed.value) == "the deployments registry kept changing; live not moved to r1"
    assert len(tries) == 5


def test_moving_live_refuses_an_unsafe_or_unknown_id_and_two_live_rows_by_message(tmp_path):
    store = DeltaStore(tmp_path)
    _register(store, "base")
    with pytest.raises(ValueError) as unsafe:
        set_live(store, "x' OR 1=1 --")
    assert str(unsafe.value) == 'deployment id "x\' OR 1=1 --" must match [A-Za-z0-9_.:-]+'
    with pytest.raises(KeyError) as unknown:
        set_live(store, "nope")
    assert unknown.value.args == ("deployment 'nope' is not registered",)
    rows = store.read("deployments").to_pylist()
    store.append("deployments", [{**rows[0], "deployment_id": d, "live": True} for d in ("a", "b")])
    with pytest.raises(RuntimeError) as two:
        live_deployment(store)
    assert str(two.value) == "2 deployments are marked live; expected one"


def test_moving_live_takes_a_log_checkpoint_at_each_tenth_version(tmp_path, caplog):
    store = DeltaStore(tmp_path)
    _register(store, "base", "r1")  # versions 0 and 1
    for k in range(8):  # versions 2 to 9
        set_live(store, ("base", "r1")[k % 2])
    log = tmp_path / "deployments" / "_delta_log"
    (log / "00000000000000000010.checkpoint.parquet").mkdir()  # version 10's checkpoint cannot be written
    set_live(store, "base")
    assert "table 'deployments': the log checkpoint at version 10 failed" in caplog.text
    (log / "00000000000000000010.checkpoint.parquet").rmdir()
    for k in range(10):  # versions 11 to 20
        set_live(store, ("r1", "base")[k % 2])
    assert sorted(p.name for p in log.glob("*.checkpoint.parquet")) == [
        "00000000000000000020.checkpoint.parquet"
    ]
    assert live_deployment(store)["deployment_id"] == "base"


def test_maintenance_compacts_vacuums_the_replaced_files_and_reports_what_it_did(tmp_path):
    store = DeltaStore(tmp_path)
    for i in range(3):
        store.append("rejects", [_reject(i)])
    files = lambda: sorted((tmp_path / "rejects").glob("part-*.parquet"))  # noqa: E731
    assert len(files()) == 3
    done = store.maintain("rejects", retention_hours=0)
    assert done == {"files_removed": 3, "files_added": 1, "vacuumed": 3, "version": 5}
    # the store made the table with its properties: nothing to set, a compaction and a vacuum
    operations = [h["operation"] for h in store.table("rejects").history()]
    assert operations == ["VACUUM END", "VACUUM START", "OPTIMIZE", "WRITE", "WRITE", "WRITE"]
    assert len(files()) == 1 and store.table("rejects").version() == 5
    assert sorted(r["record_id"] for r in store.read("rejects").to_pylist()) == ["r0", "r1", "r2"]


def test_queries_note_the_versions_they_read_when_lineage_is_on(tmp_path):
    store = DeltaStore(tmp_path, lineage=True)
    for i in range(3):
        store.append("rejects", [_reject(i)])
    _register(store, "base")
    got = store.query(
        "SELECT count(*) AS n FROM rejects, deployments", ["rejects", "deployments"], {"rejects": 1}
    ).to_pylist()
    assert got == [{"n": 2}]
    assert store.versions_read == {"rejects": {1}, "deployments": {0}}
    quiet = DeltaStore(tmp_path)
    quiet.query("SELECT count(*) FROM rejects", ["rejects"])
    assert quiet.versions_read == {}


def test_a_first_write_that_fails_says_the_table_does_not_exist(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    store = DeltaStore(blocked)
    with pytest.raises(StorageError) as failed:
        store.append("rejects", [_reject(0)])
    assert str(failed.value).startswith("writing 1 rows to table 'rejects' failed: ")
    assert str(failed.value).endswith("; the table stays at its last committed version (none)")


def test_moving_live_on_a_registry_made_before_the_store_s_properties_deletes_no_commit_file(tmp_path):
    """A registry written by an older prodrl has deltalake's defaults (expired logs cleaned up at a
    commit): moving live must not delete commit files older than the log's retention, which a
    replay of a pinned version reads."""
    import os
    import time

    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    from prodrl_pipeline.records.schema import TABLES

    for k, dep in enumerate(("base", "r1")):
        row = {
            "deployment_id": dep,
            "round": k,
            "checkpoint_id": dep,
            "path": "p",
            "quant_format": "nvfp4",
            "sampling_json": "{}",
            "live": False,
            "created_at": NOW,
        }
        write_deltalake(
            tmp_path / "deployments", pa.Table.from_pylist([row], schema=TABLES["deployments"]), mode="append"
        )
    DeltaTable(tmp_path / "deployments").create_checkpoint()
    log = tmp_path / "deployments" / "_delta_log"
    sixty_days_ago = time.time() - 60 * 86400
    for commit in log.glob("*.json"):
        os.utime(commit, (sixty_days_ago, sixty_days_ago))
    store = DeltaStore(tmp_path)
    set_live(store, "r1")
    assert sorted(p.name for p in log.glob("*.json")) == [f"{v:020d}.json" for v in range(3)]
    assert store.read("deployments", version=0).to_pylist()[0]["deployment_id"] == "base"


def test_updating_a_row_if_it_still_matches_lets_exactly_one_of_racing_writers_win(tmp_path):
    import threading

    _register(DeltaStore(tmp_path), "base", "r1", "r2")
    stores = [DeltaStore(tmp_path) for _ in range(4)]
    row = stores[0].read("deployments").to_pylist()[1]  # r1
    gate, won = threading.Barrier(len(stores)), []

    def decide(i: int) -> None:
        gate.wait()
        if stores[i].update_if(
            "deployments", {**row, "path": f"w{i}"}, "deployment_id", ["path"], "t.path = 'p'"
        ):
            won.append(i)

    threads = [threading.Thread(target=decide, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    paths = {r["deployment_id"]: r["path"] for r in stores[0].read("deployments").to_pylist()}
    assert paths == {"base": "p", "r1": f"w{won[0]}", "r2": "p"}  # one row replaced, by the winner
    late = {**row, "path": "late", "round": 7}
    assert not stores[0].update_if("deployments", late, "deployment_id", ["path"], "t.path = 'p'")
    assert stores[0].update_if("deployments", late, "deployment_id", ["round"], "true")  # that column only
    r1 = next(r for r in stores[0].read("deployments").to_pylist() if r["deployment_id"] == "r1")
    assert (r1["path"], r1["round"]) == (f"w{won[0]}", 7)
    assert not stores[0].update_if(
        "deployments", {**row, "deployment_id": "r9"}, "deployment_id", ["path"], "true"
    )
    assert not DeltaStore(tmp_path / "none").update_if("deployments", row, "deployment_id", ["path"], "true")
