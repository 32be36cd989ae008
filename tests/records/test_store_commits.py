"""What the store leaves in each commit and in its log lines: the commit metadata a reader of a
table's history finds (the store's, and which rows an overwrite replaced), the lost races and
failed checkpoints it logs, and deltalake's errors made one plain line."""

import logging
import shutil

import pyarrow as pa
import pytest

from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import DeltaStore, StorageError, _one_line
from tests.records.test_store import NOW, _call, _reject
from tests.records.test_store_writes import _racing


def _metadata(store: DeltaStore, table: str) -> list[dict]:
    """Each commit's metadata beyond deltalake's own fields, newest first."""
    own = {"operation", "operationParameters", "operationMetrics", "engineInfo", "clientVersion", "timestamp"}
    return [{k: v for k, v in h.items() if k not in own} for h in store.table(table).history()]


def test_every_commit_carries_the_store_s_metadata_and_an_overwrite_names_its_predicate(tmp_path):
    store = DeltaStore(tmp_path, commit_metadata={"dagster_run_id": "run-3"})
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    store.overwrite("calls", [_call(0, 1, [2], [-1.0])], "call_id = 'c0'")
    store.append("calls", [_call(2, 2, [1], [-1.0])])
    assert _metadata(store, "calls") == [
        {"dagster_run_id": "run-3", "version": 2},
        {"dagster_run_id": "run-3", "predicate": "call_id = 'c0'", "version": 1},
        {"dagster_run_id": "run-3", "predicate": "round = 1", "version": 0},
    ]


def test_a_lost_race_is_logged_naming_the_table_the_predicate_and_the_conflict(tmp_path, monkeypatch, caplog):
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    _racing(monkeypatch, tmp_path, [([_call(90, 1, [1], [-1.0])],)])
    with caplog.at_level(logging.INFO, logger="prodrl_pipeline.records.store"):
        store.overwrite_round("calls", [_call(1, 1, [1], [-1.0])], 1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("table 'calls': the overwrite of round = 1 lost a race; again: ")
    reason = line.removeprefix("table 'calls': the overwrite of round = 1 lost a race; again: ")
    assert "oncurrent" in reason and "\n" not in reason


def test_a_failed_checkpoint_is_logged_with_its_table_and_cause(tmp_path, caplog):
    store = DeltaStore(tmp_path)
    for i in range(10):
        store.append("calls", [_call(i, 1, [i], [-0.5])])
    (tmp_path / "calls" / "_delta_log" / "00000000000000000010.checkpoint.parquet").mkdir()
    store.append("calls", [_call(10, 1, [10], [-0.5])])
    (record,) = [r for r in caplog.records if "checkpoint" in r.getMessage()]
    assert record.levelno == logging.WARNING
    prefix = "table 'calls': the log checkpoint at version 10 failed: "
    assert record.getMessage().startswith(prefix) and record.getMessage() != prefix
    assert record.getMessage().removeprefix(prefix) != "None"


def test_deltalake_s_colored_cause_chain_is_made_one_plain_line():
    error = Exception("\x1b[1;31mGeneric error\x1b[0m\n   ↳ \x1b[2mcause one\x1b[0m\n\n  ↳ cause ↳ two  ")
    assert _one_line(error) == "Generic error: cause one: cause ↳ two"
    assert _one_line(Exception("one line, no color")) == "one line, no color"


def test_rows_come_back_in_the_tables_own_schema_whatever_arrow_types_they_were_given_in(tmp_path):
    """DataFusion reads strings as string views; the store gives the schema's types back. Rows
    given as an Arrow table of other (castable) types and column order are written as the schema's."""
    store = DeltaStore(tmp_path)
    given = pa.table(
        {
            "rejected_at": pa.array([NOW], pa.timestamp("ns", tz="UTC")),
            "record_json": pa.array(["{}"], pa.large_string()),
            "reason": pa.array(["why"], pa.large_string()),
            "record_id": pa.array(["r0"], pa.large_string()),
            "round": pa.array([3], pa.int32()),
            "table_name": pa.array(["calls"], pa.large_string()),
            "extra": pa.array([1]),
        }
    )
    store.append("rejects", given)
    store.append("rejects", given)
    assert store.table("rejects").schema().to_arrow() == TABLES["rejects"]
    read = store.read("rejects")
    assert read.schema == TABLES["rejects"] and store.read("rejects", 3).schema == TABLES["rejects"]
    assert (
        read.to_pylist()
        == [
            {
                "table_name": "calls",
                "round": 3,
                "record_id": "r0",
                "reason": "why",
                "record_json": "{}",
                "rejected_at": NOW,
            }
        ]
        * 2
    )


def test_a_store_names_its_root_without_a_trailing_slash_and_refuses_unknown_tables(tmp_path):
    assert DeltaStore(f"{tmp_path}/MAX/").root == f"{tmp_path}/MAX"
    assert DeltaStore(f"{tmp_path}/MAX/").uri("calls") == f"{tmp_path}/MAX/calls"
    with pytest.raises(KeyError) as unknown:
        DeltaStore(tmp_path).uri("call")
    assert unknown.value.args[0].startswith("unknown table 'call'; known: ['advantages', ")
    quiet = DeltaStore(tmp_path)  # lineage is off unless asked for: a long-lived writer keeps nothing
    quiet.append("rejects", [_reject(0)])
    quiet.read("rejects")
    assert (quiet.versions_read, quiet.versions_written) == ({}, {})


def test_a_table_another_writer_creates_in_the_round_being_overwritten_keeps_none_of_its_rows(
    tmp_path, monkeypatch
):
    """The store found no table and creates it as an append; another writer made it first with rows
    in the very round overwritten: the overwrite is made again over it, and names its predicate."""
    store = DeltaStore(tmp_path, commit_metadata={"dagster_run_id": "run-5"})
    _racing(monkeypatch, tmp_path, [([_call(9, 3, [1], [-1.0]), _call(8, 2, [1], [-1.0])],)])
    store.overwrite_round("calls", [_call(3, 3, [1], [-1.0])], 3)
    assert sorted((r["round"], r["call_id"]) for r in store.read("calls").to_pylist()) == [
        (2, "c8"),
        (3, "c3"),
    ]
    assert _metadata(store, "calls")[0] == {"dagster_run_id": "run-5", "predicate": "round = 3", "version": 2}


def test_a_store_s_first_write_makes_one_commit(tmp_path):
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(3, 3, [1], [-1.0])], 3)
    assert store.table("calls").version() == 0


def test_a_corrupt_log_met_by_a_write_fails_it_naming_the_table(tmp_path, monkeypatch):
    """Another writer leaves a garbled commit: made while the store creates the table, the error
    says the table's log is corrupt; met while committing to a table the store read, the write's
    error names the table and that its version could not be read either."""
    import prodrl_pipeline.records.store as store_module

    real = store_module.write_deltalake
    garbled = {"version": 0}

    def garbling(target, data, **kwargs):  # noqa: ANN001, ANN003
        log = tmp_path / "rejects" / "_delta_log"
        log.mkdir(parents=True, exist_ok=True)
        (log / f"{garbled['version']:020d}.json").write_text('{"commitInfo":{"timestamp":1')
        return real(target, data, **kwargs)

    monkeypatch.setattr(store_module, "write_deltalake", garbling)
    with pytest.raises(StorageError) as corrupt:
        DeltaStore(tmp_path).append("rejects", [_reject(0)])
    assert str(corrupt.value).startswith(
        f"table 'rejects' ({tmp_path}/rejects) is unreadable: its Delta log is corrupt, a commit file in "
        "_delta_log is truncated or garbled ("
    )
    shutil.rmtree(tmp_path / "rejects")
    monkeypatch.setattr(store_module, "write_deltalake", real)
    store = DeltaStore(tmp_path)
    store.append("rejects", [_reject(0)])
    garbled["version"] = 1
    monkeypatch.setattr(store_module, "write_deltalake", garbling)
    with pytest.raises(StorageError) as failed:
        store.append("rejects", [_reject(1)])
    assert str(failed.value).startswith("writing 1 rows to table 'rejects' failed: ")
    assert str(failed.value).endswith(
        "; the table stays at its last committed version (unknown: reading it failed too, StorageError)"
    )
