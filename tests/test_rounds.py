"""Decisions about a round (prodrl_pipeline/rounds.py), without Dagster."""

import pytest

from prodrl_pipeline.rounds import (
    MAX_DEATHS,
    goes_live,
    parent_checkpoint,
    runs_again,
    start_blocker,
    traffic_deployment,
)

BASE_ROW = {"deployment_id": "base", "round": 0, "checkpoint_id": "base"}


def _dep(k: int) -> dict:
    return {"deployment_id": f"main-r{k:06d}", "round": k, "checkpoint_id": f"main-r{k:06d}"}


def test_sync_starts_a_round_once_the_previous_one_is_deployed():
    assert start_blocker("sync", 0, {}) is None
    assert (
        start_blocker("sync", 2, {1: {"advantages", "deployment"}, 2: {"advantages"}})
        == "round 2 is still in flight"
    )
    assert start_blocker("sync", 2, {2: {"advantages", "deployment"}}) is None


def test_a_round_whose_canary_is_open_is_not_deployed_until_it_is_decided():
    done = {1: {"advantages", "deployment"}, 2: {"advantages", "deployment"}}
    assert start_blocker("sync", 2, done, undecided=[2]) == "round 2's canary is not decided yet"
    assert start_blocker("sync", 2, done, undecided=[1]) is None  # an older round's canary: sync waits on k
    assert start_blocker("async1", 2, done, undecided=[1]) == "round 1's canary is not decided yet"
    assert start_blocker("async1", 2, done, undecided=[2]) is None  # round 2 trains while its canary runs


def test_a_failed_round_stops_later_rounds_until_it_is_re_run():
    done = {1: {"advantages", "deployment"}, 2: {"advantages"}}
    assert "round 2's last run failed" in start_blocker("sync", 2, done, failed=[2])
    assert "round 2's last run failed" in start_blocker("async1", 2, done, failed=[2])
    assert "round 2's last run failed" in start_blocker("async1", 3, {**done, 3: {"advantages"}}, failed=[2])
    # a failed round that was deployed anyway (its eval_report failed) does not block
    assert start_blocker("sync", 2, {1: {"deployment"}, 2: {"deployment"}}, failed=[1, 2]) is None


def test_a_round_whose_run_died_runs_again_until_it_died_too_often_or_was_deployed():
    done = {1: {"advantages", "deployment"}, 2: {"advantages"}}
    assert runs_again({2: 1}, done) == [2]
    assert runs_again({1: 1, 2: MAX_DEATHS - 1}, done) == [2]  # round 1 was deployed before its run died
    assert runs_again({2: MAX_DEATHS}, done) == []  # an operator looks at it now
    assert runs_again({2: 1, 3: 1}, {**done, 3: set()}) == [2, 3]  # async1: both rounds in flight died
    assert runs_again({}, done) == []


def test_async1_overlaps_collection_of_round_k_plus_1_with_training_of_round_k():
    assert start_blocker("async1", 0, {}) is None
    assert "not taken its traffic" in start_blocker("async1", 1, {})
    assert start_blocker("async1", 1, {1: {"advantages"}}) is None  # round 1 trains: round 2 may collect
    assert "round 1 is not deployed" in start_blocker("async1", 2, {1: {"advantages"}, 2: {"advantages"}})
    assert start_blocker("async1", 2, {1: {"advantages", "deployment"}, 2: {"advantages"}}) is None
    # at most two rounds in flight: round 3 may not start while round 2 has not taken its traffic
    assert "round 2 has not taken" in start_blocker("async1", 2, {1: {"advantages", "deployment"}})


@pytest.mark.parametrize(
    ("source", "schedule", "round_", "expected"),
    [
        ("lab", "sync", 3, "main-r000002"),  # the live deployment
        ("lab", "async1", 1, "base"),
        ("lab", "async1", 2, "base"),
        ("lab", "async1", 3, "main-r000001"),  # two rounds back, whatever is live
        ("production", "sync", 3, "main-r000002"),
        ("production", "async1", 3, "main-r000002"),  # production traffic is always the live one's
    ],
)
def test_traffic_comes_from_the_deployment_the_schedule_names(source, schedule, round_, expected):
    registered = {d["deployment_id"]: d for d in (BASE_ROW, _dep(1), _dep(2))}
    got = traffic_deployment(
        source=source,
        schedule=schedule,
        counterfactual=False,
        experiment="main",
        round_=round_,
        live=_dep(2),
        registered=registered,
    )
    assert got["deployment_id"] == expected


def test_production_snapshots_the_deployment_the_sensor_counted_even_after_live_moved():
    registered = {d["deployment_id"]: d for d in (BASE_ROW, _dep(1), _dep(2))}
    common = dict(counterfactual=False, experiment="main", round_=3, live=_dep(2), registered=registered)
    got = traffic_deployment(source="production", schedule="async1", counted="main-r000001", **common)
    assert got["deployment_id"] == "main-r000001"
    with pytest.raises(ValueError, match="snapshots traffic of gone"):
        traffic_deployment(source="production", schedule="sync", counted="gone", **common)


def test_traffic_is_refused_for_counterfactual_replays_without_live_and_for_unregistered_sources():
    common = dict(source="lab", experiment="main", round_=4, live=_dep(2), registered={})
    with pytest.raises(ValueError, match="counterfactual"):
        traffic_deployment(schedule="sync", counterfactual=True, **common)
    with pytest.raises(ValueError, match="main-r000002, which is not registered"):
        traffic_deployment(schedule="async1", counterfactual=False, **common)
    with pytest.raises(ValueError, match="no live deployment"):
        traffic_deployment(schedule="sync", counterfactual=False, **{**common, "live": None})


def test_the_parent_is_the_serving_checkpoint_in_sync_and_the_previous_round_otherwise():
    common = dict(experiment="main", round_=3, served_checkpoint="main-r000001")
    assert parent_checkpoint(schedule="sync", counterfactual=False, **common) == "main-r000001"
    assert parent_checkpoint(schedule="async1", counterfactual=False, **common) == "main-r000002"
    assert parent_checkpoint(schedule="sync", counterfactual=True, **common) == "main-r000002"
    assert parent_checkpoint(schedule="async1", counterfactual=False, **{**common, "round_": 1}) == "base"


def test_live_moves_forward_only_after_a_passed_gate_against_what_is_still_live():
    def live_after(
        k: int, passed: bool = True, counterfactual: bool = False, live: dict | None = None
    ) -> bool:
        name = ("cf" if counterfactual else "main") + f"-r{k:06d}"
        return goes_live(
            gate_passed=passed,
            counterfactual=counterfactual,
            round_=k,
            candidate=name,
            gated_against="main-r000002",
            live=_dep(2) if live is None else live,
        )

    assert live_after(3)
    assert not live_after(3, passed=False)
    assert not live_after(3, counterfactual=True)
    assert not live_after(1)  # a replay of an old round never moves it back
    assert live_after(2)  # re-deploying the live round keeps it live
    assert not live_after(3, live=_dep(4))  # round 4 went live while round 3 was evaluated
    assert not live_after(4, live=_dep(3))  # live moved since the gate: not gated against round 3
    assert not goes_live(
        gate_passed=True, counterfactual=False, round_=3, candidate="c", gated_against="g", live=None
    )


def test_rounds_missing_from_done_count_as_having_nothing_materialized():
    assert start_blocker("sync", 2, {}, failed={2}) == (
        "round 2's last run failed: re-run it (Materialize its partition) to continue"
    )
    assert start_blocker("sync", 2, {}) == "round 2 is still in flight"
    assert start_blocker("async1", 3, {3: {"advantages"}}) == "round 2 is not deployed yet"
    assert start_blocker("async1", 3, {}) == "round 3 has not taken its traffic yet"


def test_traffic_refusals_give_their_whole_reason():
    common = dict(source="lab", experiment="main", round_=4, live=_dep(2), registered={})
    with pytest.raises(ValueError) as refused:
        traffic_deployment(schedule="sync", counterfactual=True, **common)
    assert str(refused.value) == (
        "round 4: a counterfactual replay trains on stored traffic only; "
        "materialize the round's trajectories in the original experiment first"
    )
    with pytest.raises(ValueError) as refused:
        traffic_deployment(schedule="sync", counterfactual=False, **{**common, "live": None})
    assert str(refused.value) == "no live deployment: materialize base_model first"


def test_live_never_moves_to_a_round_no_newer_than_the_live_one():
    # the gate ran against the live deployment of the same round number (another experiment's)
    assert not goes_live(
        gate_passed=True,
        counterfactual=False,
        round_=2,
        candidate="main-r000002",
        gated_against="other-r000002",
        live={"deployment_id": "other-r000002", "round": 2},
    )
