"""The round's asset-check logic (records/checks.py) on hand-made rows: each way a check must fail,
the metadata it reports, and the edges where it must still pass."""

import math

import pyarrow as pa
import pytest

from prodrl_pipeline.records.checks import advantage_sanity, mismatch_monitor, token_integrity
from prodrl_pipeline.records.schema import CALLS, TRAJECTORIES
from tests.records.test_validate import _call, _traj


def _integrity(calls: list[dict], trajectories: list[dict]) -> tuple[bool, dict]:
    """token_integrity over the rows stored as tables (what the asset check reads)."""
    return token_integrity(
        pa.Table.from_pylist(calls, schema=CALLS), pa.Table.from_pylist(trajectories, schema=TRAJECTORIES)
    )


def test_token_integrity_passes_sound_rounds_and_counts_each_fault():
    calls, trajs = [_call("a"), _call("b")], [_traj("a"), _traj("b")]
    assert _integrity(calls, trajs) == (
        True,
        {
            "calls": 2,
            "trajectories": 2,
            "contract_violations": 0,
            "first_violations": "",
            "unscored": 0,
            "n_calls_mismatch": 0,
            "calls_without_trajectory": 0,
        },
    )
    assert _integrity([], [])[0] is False  # an empty round is not a sound one

    broken = [_call(f"x{i}", completion_logprobs=[0.5, 0.0]) for i in range(7)]
    passed, meta = _integrity(calls + broken, trajs + [_traj(f"x{i}") for i in range(7)])
    assert not passed and meta["contract_violations"] == 7
    lines = meta["first_violations"].split("\n")
    assert lines == [f"x{i}-0: position 0: log-prob 0.5 is not finite and <= 0" for i in range(5)]

    for reward in (None, math.nan, math.inf):
        passed, meta = _integrity(calls, [_traj("a", reward=reward), _traj("b")])
        assert not passed and meta["unscored"] == 1
    passed, meta = _integrity(calls, [_traj("a", n_calls=2), _traj("b")])
    assert not passed and meta["n_calls_mismatch"] == 1
    passed, meta = _integrity(calls + [_call("orphan")], trajs)
    assert not passed and meta["calls_without_trajectory"] == 1 and meta["calls"] == 3
    two = [_call("c"), _call("c", call_id="c-1", call_index=1)]  # a trajectory of two calls
    assert _integrity(two, [_traj("c", n_calls=2)])[0]


def _adv(tid, advantage, minibatch=0):
    return {"trajectory_id": tid, "advantage": advantage, "minibatch": minibatch}


def test_advantage_sanity_wants_one_finite_advantage_per_known_trajectory_summing_to_zero():
    ids = {"a", "b", "c", "d"}
    rows = [_adv("a", 0.5), _adv("b", -0.5), _adv("c", 2.0, 1), _adv("d", -2.0, 1)]
    passed, meta = advantage_sanity(rows, ids)
    assert passed and meta == {
        "rows": 4,
        "nonfinite": 0,
        "duplicates": 0,
        "unknown_trajectories": 0,
        "max_abs_minibatch_sum": 0.0,
        "minibatches": 2,
    }
    assert advantage_sanity(rows[:2], ids)[0]  # a subset of the round's trajectories is fine
    assert advantage_sanity([], ids) == (
        False,
        {
            "rows": 0,
            "nonfinite": 0,
            "duplicates": 0,
            "unknown_trajectories": 0,
            "max_abs_minibatch_sum": 0.0,
            "minibatches": 0,
        },
    )
    assert not advantage_sanity([_adv("a", 1e-6), _adv("b", 0.0)], ids)[0]  # 1e-6 is already off zero

    passed, meta = advantage_sanity([_adv("a", 0.5 + 9e-7), _adv("b", -0.5)], ids)
    assert passed and meta["max_abs_minibatch_sum"] == pytest.approx(9e-7)  # float error tolerated
    passed, meta = advantage_sanity([_adv("a", 0.5), _adv("b", -0.4), _adv("c", 0.0, 1)], ids)
    assert not passed and meta["max_abs_minibatch_sum"] == pytest.approx(0.1)  # a minibatch off zero
    passed, meta = advantage_sanity([_adv("a", 0.5), _adv("b", -0.5, 1)], ids)
    assert not passed and meta["max_abs_minibatch_sum"] == 0.5  # summing per minibatch, not overall
    passed, meta = advantage_sanity([_adv("a", math.nan), _adv("b", 0.0)], ids)
    assert not passed and meta["nonfinite"] == 1
    passed, meta = advantage_sanity([_adv("a", 0.0), _adv("a", 0.0)], ids)
    assert not passed and meta["duplicates"] == 1
    passed, meta = advantage_sanity([_adv("z", 0.0)], ids)
    assert not passed and meta["unknown_trajectories"] == 1


def _step(round_, mismatch, staleness=0.0):
    return {"round": round_, "engine_mismatch": mismatch, "staleness": staleness}


def test_mismatch_monitor_warns_on_a_high_round_and_on_a_sustained_rise_above_the_threshold():
    # round 4's mean mismatch is (0.125 + 0.375) / 2 = 0.25; a later round's rows are ignored
    steps = [_step(1, 0.1), _step(2, 0.15), _step(3, 0.2), _step(4, 0.125), _step(4, 0.375), _step(5, 9.0)]
    passed, sustained, meta = mismatch_monitor(steps, 4, mismatch_warn=0.2, staleness_warn=1.0)
    assert not passed and sustained
    assert meta["engine_mismatch"] == 0.25
    assert meta["recent_engine_mismatch"] == "[0.1, 0.15, 0.2, 0.25]"
    assert meta["sustained_rise"] is True and meta["mismatch_warn"] == 0.2 and meta["staleness_warn"] == 1.0

    # at the threshold is not above it; a rise that ends below the threshold is not sustained
    assert mismatch_monitor(steps, 4, 0.25, 1.0)[:2] == (True, False)
    # three rounds of history are too few for a sustained rise over three rounds
    assert mismatch_monitor(steps[1:], 4, 0.01, 1.0)[1] is False
    # a flat step breaks the rise
    flat = [_step(1, 0.1), _step(2, 0.2), _step(3, 0.2), _step(4, 0.3)]
    assert mismatch_monitor(flat, 4, 0.01, 1.0)[:2] == (False, False)
    # only the last SUSTAINED_ROUNDS + 1 rounds count: an early dip does not break a later rise
    dip = [_step(1, 0.5), _step(2, 0.1), _step(3, 0.2), _step(4, 0.3), _step(5, 0.4)]
    assert mismatch_monitor(dip, 5, 0.01, 1.0)[1] is True
    fine = [_step(1, 0.1234567)]
    assert mismatch_monitor(fine, 1, 1.0, 1.0)[2]["recent_engine_mismatch"] == "[0.12346]"  # 5 decimals

    passed, sustained, meta = mismatch_monitor([_step(1, 0.0, staleness=2.0)], 1, 0.1, 1.5)
    assert not passed and not sustained and meta["staleness"] == 2.0
    assert mismatch_monitor([_step(1, 0.0, staleness=1.5)], 1, 0.1, 1.5)[0] is True
    assert mismatch_monitor(steps, 7, 0.1, 1.0) == (False, False, {"reason": "no train_steps for round 7"})
