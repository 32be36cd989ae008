"""What the store leaves in each commit and in its log lines: the commit metadata a reader of a
table's history finds (the store's, and which rows an overwrite replaced), the lost races and
failed checkpoints it logs, and deltalake's errors made one plain line."""

import logging

from prodrl_pipeline.records.store import DeltaStore, _one_line
from tests.records.test_store import _call
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
