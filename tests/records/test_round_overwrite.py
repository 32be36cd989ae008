"""A round overwrite meeting rows whose round is null: only DeltaStore's public writes and reads
(`overwrite_round`, `overwrite`, `append`, `read`), checked against rows listed by hand."""

from datetime import UTC, datetime

import pytest

from prodrl_pipeline.records.store import DeltaStore

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def _result(round_: int | None, puzzle: str) -> dict:
    """An `eval_results` row (a partitioned table) told apart by its puzzle id."""
    return {
        "round": round_,
        "deployment_id": "d",
        "puzzle_id": puzzle,
        "themes": "mate",
        "reward": 1.0,
        "solved": True,
        "n_calls": 1,
    }


def _reject(round_: int | None, table: str, record: str) -> dict:
    return {
        "table_name": table,
        "round": round_,
        "record_id": record,
        "reason": "why",
        "record_json": "{}",
        "rejected_at": NOW,
    }


def _rows(store: DeltaStore, table: str, round_: int | None = None) -> set[tuple]:
    key = "puzzle_id" if table == "eval_results" else "record_id"
    return {(r[key], r["round"]) for r in store.read(table, round_).to_pylist()}


@pytest.mark.parametrize("together", [True, False], ids=["nulls-appended-with-rounds", "nulls-alone"])
def test_a_round_overwrite_replaces_exactly_its_round_and_keeps_the_null_round_rows(tmp_path, together):
    store = DeltaStore(tmp_path)
    before = [_result(1, "a1"), _result(None, "n1"), _result(2, "b1"), _result(None, "n2"), _result(2, "b2")]
    if together:
        store.append("eval_results", before)
    else:  # one append per round, the null round's on its own
        for round_ in (1, None, 2):
            store.append("eval_results", [r for r in before if r["round"] == round_])
    assert store.overwrite_round("eval_results", [_result(2, "b3")], 2) == 1
    nulls = {("n1", None), ("n2", None)}
    assert _rows(store, "eval_results") == {("a1", 1), ("b3", 2)} | nulls
    assert _rows(store, "eval_results", 2) == {("b3", 2)}
    assert _rows(store, "eval_results", 1) == {("a1", 1)}

    store.overwrite_round("eval_results", [_result(1, "a2"), _result(1, "a3")], 1)
    store.overwrite_round("eval_results", [], 2)  # round 2 emptied: the null round is not round 2
    expected = {("a2", 1), ("a3", 1)} | nulls
    assert _rows(store, "eval_results") == expected
    assert _rows(DeltaStore(tmp_path), "eval_results") == expected  # another process reads the same
    assert _rows(DeltaStore(tmp_path), "eval_results", 2) == set()


@pytest.mark.parametrize("write", ["overwrite_round", "overwrite"])
def test_an_overwrite_whose_rows_include_a_null_round_is_refused_counting_them_and_writes_nothing(
    tmp_path, write
):
    store = DeltaStore(tmp_path)
    store.append("eval_results", [_result(2, "b1"), _result(None, "n1")])

    def replace(rows):
        if write == "overwrite_round":
            return store.overwrite_round("eval_results", rows, 2)
        return store.overwrite("eval_results", rows, "round = 2")

    for rows, outside in (
        ([_result(2, "b2"), _result(None, "x"), _result(None, "y")], 2),  # two null rounds among round 2's
        ([_result(None, "x")], 1),
        ([_result(2, "b2"), _result(3, "c"), _result(None, "x")], 2),  # another round and a null one
    ):
        with pytest.raises(ValueError) as refused:
            replace(rows)
        assert str(refused.value) == (
            f"{outside} rows failed validation: the overwrite of table 'eval_results' replaces round 2 "
            "and these rows have another round"
        )
        assert _rows(store, "eval_results") == {("b1", 2), ("n1", None)}  # nothing written
    assert replace([_result(2, "b2")]) == 1  # round 2's rows alone pass
    assert _rows(DeltaStore(tmp_path), "eval_results") == {("b2", 2), ("n1", None)}


def test_a_predicate_overwrite_of_a_round_s_rejects_leaves_the_null_round_rejects(tmp_path):
    """`rejects` (unpartitioned) holds rejects of a round's rows and, with a null round, trajectories
    the gateway expired unscored; the trajectories asset replaces one round's calls and trajectories
    rejects with exactly this predicate."""
    store = DeltaStore(tmp_path)
    store.append(
        "rejects",
        [
            _reject(None, "landing_trajectories", "expired-1"),
            _reject(1, "calls", "c1"),
            _reject(2, "calls", "c2"),
            _reject(2, "trajectories", "t2"),
            _reject(2, "landing_feedback", "f2"),
        ],
    )
    store.append("rejects", [_reject(None, "calls", "null-call")])
    predicate = "round = 2 AND table_name IN ('calls', 'trajectories')"
    assert store.overwrite("rejects", [_reject(2, "calls", "c2-new")], predicate) == 1
    nulls = {("expired-1", None), ("null-call", None)}
    assert _rows(store, "rejects") == {("c1", 1), ("c2-new", 2), ("f2", 2)} | nulls
    store.overwrite("rejects", [], "round = 2")
    assert _rows(store, "rejects") == {("c1", 1)} | nulls
    assert _rows(DeltaStore(tmp_path), "rejects", 2) == set()
