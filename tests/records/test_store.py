import struct
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pytest

from prodrl_pipeline.records.registry import live_deployment, move_live, register_deployment, set_live
from prodrl_pipeline.records.store import TABLE_PROPERTIES, DeltaStore

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def _register(store: DeltaStore, *ids: str) -> None:
    """Register deployments `ids` as rounds 0, 1, ... (placeholder paths)."""
    for k, dep in enumerate(ids):
        register_deployment(
            store,
            deployment_id=dep,
            round_=k,
            checkpoint_id=dep,
            path="p",
            quant_format="nvfp4",
            sampling_json="{}",
        )


def _reject(i: int) -> dict:
    """A rejects row, `r{i}`."""
    return {
        "table_name": "calls",
        "round": 1,
        "record_id": f"r{i}",
        "reason": "x",
        "record_json": "{}",
        "rejected_at": NOW,
    }


def _call(i: int, round_: int, ids: list[int], lps: list[float]) -> dict:
    return {
        "call_id": f"c{i}",
        "trajectory_id": f"t{i}",
        "call_index": 0,
        "round": round_,
        "deployment_id": "d",
        "prompt_token_ids": ids,
        "completion_token_ids": ids,
        "completion_logprobs": lps,
        "topk_token_ids": [[x] for x in ids],
        "topk_logprobs": [[x] for x in lps],
        "support_size": [1] * len(ids),
        "support_token_ids": [[] for _ in ids],
        "vocab_size": 2**31 - 1,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "seed": 1},
        "finish_reason": "stop",
        "messages_json": "[]",
        "created_at": NOW,
    }


def test_token_ids_and_logprobs_round_trip_bit_exactly(tmp_path):
    rng = np.random.default_rng(0)
    ids = [0, 1, 2**31 - 1, 151_645, *rng.integers(0, 2**31 - 1, 60).tolist()]
    specials = [0.0, -0.0, -1e-45, -1.1754942e-38, -3.4028235e38, -np.float32(1 / 3), -9999.0]
    lps = [float(np.float32(x)) for x in specials] + (-rng.exponential(3, len(ids) - len(specials))).astype(
        np.float32
    ).tolist()
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, ids, lps)], 1)
    row = store.read("calls", 1).to_pylist()[0]
    assert row["completion_token_ids"] == ids
    bits = lambda xs: [struct.pack("<f", x) for x in xs]  # noqa: E731
    assert bits(row["completion_logprobs"]) == bits(lps)
    assert bits([h[0] for h in row["topk_logprobs"]]) == bits(lps)
    assert store.table("calls").schema().to_arrow().field("completion_logprobs").type == pa.list_(
        pa.float32()
    )


def test_rematerializing_a_round_replaces_it(tmp_path):
    store = DeltaStore(tmp_path)
    for round_ in (1, 2):
        store.overwrite_round("calls", [_call(i, round_, [1, 2], [-0.5, -1.0]) for i in range(5)], round_)
    store.overwrite_round("calls", [_call(i, 1, [1, 2], [-0.5, -1.0]) for i in range(5)], 1)
    store.overwrite_round("calls", [_call(i, 1, [1, 2], [-0.5, -1.0]) for i in range(5)], 1)
    assert store.read("calls", 1).num_rows == 5 and store.read("calls").num_rows == 10


def test_overwrite_refuses_rows_outside_the_predicate(tmp_path):
    store = DeltaStore(tmp_path)
    store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 1)
    with pytest.raises(Exception, match="failed validation"):
        store.overwrite_round("calls", [_call(0, 1, [1], [-1.0])], 2)


def test_live_pointer_is_unique(tmp_path):
    from prodrl_pipeline.records.registry import register_deployment

    store = DeltaStore(tmp_path)
    for dep in ("base", "main-r000001"):
        register_deployment(
            store,
            deployment_id=dep,
            round_=0,
            checkpoint_id=dep,
            path="p",
            quant_format="nvfp4",
            sampling_json="{}",
        )
    assert live_deployment(store) is None
    set_live(store, "base")
    set_live(store, "main-r000001")
    assert live_deployment(store)["deployment_id"] == "main-r000001"
    assert sum(r["live"] for r in store.read("deployments").to_pylist()) == 1
    with pytest.raises(KeyError):
        set_live(store, "nope")
    with pytest.raises(ValueError):
        set_live(store, "x' OR 1=1 --")


def test_moving_live_decides_on_the_row_read_and_retries_when_another_writer_moved_it(tmp_path):
    store = DeltaStore(tmp_path)
    _register(store, "base", "main-r000001", "main-r000002")
    set_live(store, "base")
    seen = []

    def round_1_may_go_live(live: dict) -> bool:
        seen.append(live["deployment_id"])
        if len(seen) == 1:  # round 2 goes live while round 1 decides: round 1's commit must not land
            set_live(store, "main-r000002")
        return live["round"] < 1

    assert not move_live(store, "main-r000001", round_1_may_go_live)
    assert seen == ["base", "main-r000002"]  # decided again on the newer live row
    assert live_deployment(store)["deployment_id"] == "main-r000002"  # never moved backwards


def test_tables_written_by_an_older_schema_still_read_and_take_new_columns(tmp_path):
    from deltalake import write_deltalake

    from prodrl_pipeline.records.schema import TRAIN_STEPS

    old_schema = pa.schema([f for f in TRAIN_STEPS if f.name != "policy_lag_steps"])
    row = {
        f.name: (1 if pa.types.is_integer(f.type) else 0.5 if pa.types.is_floating(f.type) else "x")
        for f in old_schema
    }
    write_deltalake(
        str(tmp_path / "train_steps"), pa.Table.from_pylist([row], schema=old_schema), partition_by=["round"]
    )
    store = DeltaStore(tmp_path)
    (read,) = store.read("train_steps").to_pylist()
    assert read["policy_lag_steps"] is None and read["loss"] == 0.5
    store.overwrite_round("train_steps", [{**row, "round": 2, "policy_lag_steps": 3}], 2)
    assert sorted(r["policy_lag_steps"] or 0 for r in store.read("train_steps").to_pylist()) == [0, 3]


def test_registry_ids_rows_lineage_and_lookup(tmp_path):
    from prodrl_pipeline.records.registry import (
        children,
        lookup,
        register_checkpoint,
        register_deployment,
        round_id,
    )

    assert round_id("exp", 0) == "base" and round_id("exp", 12) == "exp-r000012"
    with pytest.raises(ValueError, match="experiment name 'a b' must match"):
        round_id("a b", 1)

    store = DeltaStore(tmp_path)
    before = datetime.now(UTC)
    register_checkpoint(
        store, checkpoint_id="base", round_=0, experiment="exp", parent_id=None, path="/b", step=0
    )
    for r, parent in [(1, "base"), (2, "exp-r000001"), (3, "exp-r000001")]:
        register_checkpoint(
            store,
            checkpoint_id=round_id("exp", r),
            round_=r,
            experiment="exp",
            parent_id=parent,
            path=f"/c{r}",
            step=r * 2,
        )
    # re-registering replaces the row rather than adding one
    register_checkpoint(
        store,
        checkpoint_id="exp-r000003",
        round_=3,
        experiment="exp",
        parent_id="exp-r000001",
        path="/c3b",
        step=7,
    )
    row = lookup(store, "checkpoints", "checkpoint_id", "exp-r000003")
    assert {k: row[k] for k in ("round", "experiment", "parent_id", "path", "step")} == {
        "round": 3,
        "experiment": "exp",
        "parent_id": "exp-r000001",
        "path": "/c3b",
        "step": 7,
    }
    assert row["created_at"] >= before
    assert store.read("checkpoints").num_rows == 4
    assert children(store, "exp-r000001") == ["exp-r000002", "exp-r000003"]
    assert children(store, "base") == ["exp-r000001"] and children(store, "exp-r000003") == []
    with pytest.raises(
        KeyError, match="checkpoints: no row with checkpoint_id = 'nope'; has it been materialized"
    ):
        lookup(store, "checkpoints", "checkpoint_id", "nope")

    sampling = '{"temperature": 1.0}'

    def deploy(dep_id: str, round_: int, path: str, quant_format: str) -> None:
        register_deployment(
            store,
            deployment_id=dep_id,
            round_=round_,
            checkpoint_id=dep_id,
            path=path,
            quant_format=quant_format,
            sampling_json=sampling,
        )

    deploy("base", 0, "/d0", "nvfp4")
    set_live(store, "base")
    deploy("exp-r000001", 1, "/d1", "bf16")
    row = lookup(store, "deployments", "deployment_id", "exp-r000001")
    assert row["live"] is False  # a new deployment is not live until set_live
    assert {k: row[k] for k in ("round", "checkpoint_id", "path", "quant_format", "sampling_json")} == {
        "round": 1,
        "checkpoint_id": "exp-r000001",
        "path": "/d1",
        "quant_format": "bf16",
        "sampling_json": sampling,
    }
    # re-registering the live deployment keeps it live; re-registering another keeps it not live
    deploy("base", 0, "/d0b", "nvfp4")
    assert live_deployment(store)["path"] == "/d0b"
    deploy("exp-r000001", 1, "/d1", "bf16")
    assert live_deployment(store)["deployment_id"] == "base" and store.read("deployments").num_rows == 2


def test_registry_rows_are_stamped_in_utc_whatever_the_machine_s_zone(tmp_path, monkeypatch):
    import time

    from prodrl_pipeline.records.registry import lookup, register_checkpoint, register_deployment

    monkeypatch.setenv("TZ", "Asia/Tokyo")  # 9 hours ahead: a local-time stamp would be in the future
    time.tzset()
    try:
        store = DeltaStore(tmp_path)
        before = datetime.now(UTC)
        register_checkpoint(
            store, checkpoint_id="base", round_=0, experiment="e", parent_id=None, path="/b", step=0
        )
        register_deployment(
            store,
            deployment_id="base",
            round_=0,
            checkpoint_id="base",
            path="/d",
            quant_format="none",
            sampling_json="{}",
        )
        after = datetime.now(UTC)
        for table, key in (("checkpoints", "checkpoint_id"), ("deployments", "deployment_id")):
            assert before <= lookup(store, table, key, "base")["created_at"] <= after, table
    finally:
        monkeypatch.undo()
        time.tzset()


def test_a_query_over_a_table_whose_log_does_not_parse_names_it(tmp_path):
    from prodrl_pipeline.records.store import StorageError

    store = DeltaStore(tmp_path)
    store.append(
        "rejects",
        [
            {
                "table_name": "calls",
                "round": 1,
                "record_id": "x",
                "reason": "r",
                "record_json": "{}",
                "rejected_at": datetime(2026, 12, 1, tzinfo=UTC),
            }
        ],
    )
    store.append("trajectories", [])
    log = tmp_path / "rejects" / "_delta_log" / "00000000000000000000.json"
    text = log.read_text()
    start = text.index('"stats":"') + len('"stats":"')
    log.write_text(text[:start] + "{garbled" + text[text.index('"', start) :])  # valid JSON, bad stats
    with pytest.raises(
        StorageError, match=r"table 'rejects' \(.*rejects\).* is unreadable: its Delta log is corrupt"
    ):
        store.query("SELECT count(*) FROM rejects, trajectories", ["rejects", "trajectories"])


def test_read_gives_the_rows_written_per_round_whole_pinned_and_under_deletion_vectors(tmp_path):
    """Per round, whole, at a pinned version, after a predicate overwrite, unpartitioned, in a folder
    whose name the log URL-encodes, and once the table needs a newer reader (deletion vectors)."""
    from deltalake import DeltaTable

    store = DeltaStore(tmp_path / "tables 1 é%")
    for k in (1, 2, 3):
        store.overwrite_round("calls", [_call(10 * k + i, k, [k, i], [-0.5 * i, -1.0]) for i in range(3)], k)
    pinned = store.table("calls").version()
    store.overwrite_round("calls", [_call(99, 2, [7], [-2.0])], 2)
    store.append("calls", [_call(98, 2, [8, 9], [-0.25, -0.75])])
    reject = {"table_name": "calls", "round": 1, "record_id": "c1", "reason": "x", "rejected_at": NOW}
    store.append("rejects", [reject, {**reject, "round": 2, "record_id": "c2"}])

    def ids(table: pa.Table) -> list[str]:
        return sorted(r["call_id"] for r in table.to_pylist())

    expected = {1: ["c10", "c11", "c12"], 2: ["c98", "c99"], 3: ["c30", "c31", "c32"], 4: []}
    for k, want in expected.items():
        assert ids(store.read("calls", k)) == want
    assert ids(store.read("calls")) == sorted(sum(expected.values(), []))
    assert ids(store.read("calls", 2, version=pinned)) == ["c20", "c21", "c22"]
    assert [r["record_id"] for r in store.read("rejects", 1).to_pylist()] == ["c1"]
    row = next(r for r in store.read("calls", 2).to_pylist() if r["call_id"] == "c98")
    assert row["completion_token_ids"] == [8, 9] and row["completion_logprobs"] == [-0.25, -0.75]

    DeltaTable(store.uri("calls")).alter.set_table_properties({"delta.enableDeletionVectors": "true"})
    assert ids(store.read("calls")) == sorted(sum(expected.values(), []))


def test_a_table_takes_a_log_checkpoint_every_ten_commits_and_reads_the_same_through_it(tmp_path):
    """A long-lived table (the gateway appends a batch a commit) opens from its last checkpoint, not
    by replaying every commit; reads, latest and pinned, are unchanged by it, and no commit file is
    ever deleted (a replay pins old versions)."""
    store = DeltaStore(tmp_path)
    for i in range(12):
        store.append("calls", [_call(i, 1 + i % 2, [i], [-0.5])])
    log = tmp_path / "calls" / "_delta_log"
    assert [p.name for p in log.glob("*.checkpoint.parquet")] == ["00000000000000000010.checkpoint.parquet"]
    assert len(list(log.glob("*.json"))) == 12
    assert store.table("calls").metadata().configuration == TABLE_PROPERTIES
    assert sorted(int(r["call_id"][1:]) for r in store.read("calls", 2).to_pylist()) == [1, 3, 5, 7, 9, 11]
    assert store.read("calls").num_rows == 12 and store.read("calls", version=3).num_rows == 4


def test_a_checkpoint_that_cannot_be_written_does_not_fail_the_commit_it_follows(tmp_path, caplog):
    store = DeltaStore(tmp_path)
    for i in range(10):
        store.append("calls", [_call(i, 1, [i], [-0.5])])
    (tmp_path / "calls" / "_delta_log" / "00000000000000000010.checkpoint.parquet").mkdir()  # unwritable
    store.append("calls", [_call(10, 1, [10], [-0.5])])  # version 10: its checkpoint fails
    assert store.table("calls").version() == 10 and store.read("calls").num_rows == 11
    assert "the log checkpoint at version 10 failed" in caplog.text


def test_maintenance_gives_a_table_created_without_them_the_store_s_properties(tmp_path):
    from deltalake import write_deltalake

    from prodrl_pipeline.records.schema import TABLES

    write_deltalake(
        tmp_path / "calls", pa.Table.from_pylist([_call(0, 1, [1], [-0.5])], schema=TABLES["calls"])
    )
    store = DeltaStore(tmp_path)
    assert store.table("calls").metadata().configuration == {}
    store.maintain("calls", retention_hours=1)
    assert store.table("calls").metadata().configuration == TABLE_PROPERTIES
    assert store.read("calls").num_rows == 1
