"""The production gate's decision on a real Dagster instance over real Delta tables: rewards that
come late keep the gate waiting, then the test decides; rewards that never come roll the candidate
back at the maximum wait; an operator's override from `canary_job`'s config is recorded with who and
why; the round sensor waits for the decision."""

import json
from datetime import UTC, datetime, timedelta

import pytest
from dagster import (
    AssetMaterialization,
    DagsterRunStatus,
    Failure,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from dagster._core.test_utils import create_run_for_test

from assets.base_model import base_model
from assets.canary import CANARY_TAG, canary_job, canary_sensor
from assets.sensors import round_sensor
from prodrl_pipeline.evals.canary import CanaryConfig
from prodrl_pipeline.gateway.deployments import candidate_arm
from prodrl_pipeline.records import canaries
from prodrl_pipeline.records.registry import live_deployment, register_deployment, set_live
from tests.test_pipeline import _resources
from tests.test_sensor import _call, _feedback

GATE = CanaryConfig(share=0.5, margin=0.3, confidence=0.95, min_per_arm=4, max_wait_hours=1.0)


@pytest.fixture
def gate(tmp_path):
    """A Dagster instance, production resources and their tables, with the base deployment live."""
    resources = _resources(tmp_path, source="production")
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        yield instance, resources, resources["store"].tables()


def _canary_traffic(tables, canary: dict, n: int) -> list[str]:
    """`n` single-call trajectories routed by `canary` as the gateway routes them (unscored)."""
    tids = [f"{canary['canary_id']}-t{i}" for i in range(n)]
    rows = []
    for tid in tids:
        to_candidate = candidate_arm(canary["canary_id"], tid, canary["share"])
        row = _call(tid, canary["deployment_id"] if to_candidate else canary["control_id"])
        rows.append(
            {**row, "canary_id": canary["canary_id"], "arm": "candidate" if to_candidate else "control"}
        )
    tables.append("landing_calls", rows)
    return tids


def _open(tables, k: int) -> dict:
    register_deployment(
        tables,
        deployment_id=f"main-r{k:06d}",
        round_=k,
        checkpoint_id=f"main-r{k:06d}",
        path="unused",
        quant_format="none",
        sampling_json="{}",
    )
    return canaries.open_canary(
        tables, deployment_id=f"main-r{k:06d}", round_=k, control_id="base", config=GATE
    )


def _tick(instance, resources):
    with build_sensor_context(instance=instance, resources=resources) as ctx:
        return canary_sensor()(ctx)


def _run(instance, resources, **config):
    result = canary_job.execute_in_process(
        {"ops": {"decide_canary": {"config": config}}}, instance=instance, resources=resources
    )
    return result.get_asset_check_evaluations()


def test_late_rewards_keep_the_gate_waiting_and_missing_ones_roll_back_at_the_maximum_wait(gate):
    instance, resources, tables = gate
    late = _open(tables, 1)
    tids = _canary_traffic(tables, late, 40)
    assert "waiting: 0 candidate / 0 control" in _tick(instance, resources).skip_message
    assert _run(instance, resources, round=1) == []  # launched early by hand: nothing decided
    assert live_deployment(tables)["deployment_id"] == "base"
    tables.append("landing_feedback", [_feedback(t) for t in tids])  # the rewards come, late
    request = _tick(instance, resources)
    assert request.run_key == f"{late['canary_id']}@base"  # the canary and the control it is judged against
    (check,) = _run(instance, resources, **request.run_config["ops"]["decide_canary"]["config"])
    assert check.passed and check.description.startswith("promoted")  # all rewards 1: equal arms
    assert live_deployment(tables)["deployment_id"] == "main-r000001"

    never = _open(tables, 2)  # against base, as if round 2 was trained before the promotion
    _canary_traffic(tables, never, 40)
    assert "waiting" in _tick(instance, resources).skip_message
    row = canaries.of_round(canaries.canaries(tables), "main-r000002")
    two_hours_ago = datetime.now(UTC) - timedelta(hours=2)  # the canary opened past its max wait
    tables.overwrite("canaries", [{**row, "opened_at": two_hours_ago}], f"canary_id = '{row['canary_id']}'")
    (check,) = _run(instance, resources, round=2)
    assert not check.passed and "of 4 per arm after 2.00 h (max_wait_hours 1)" in check.description
    assert check.metadata["n_candidate"].value == 0 and "lower_bound" not in check.metadata
    assert live_deployment(tables)["deployment_id"] == "main-r000001"  # live unchanged
    assert isinstance(_tick(instance, resources).skip_message, str)  # nothing open: nothing requested


def test_an_operator_overrides_the_gate_from_the_job_config_and_the_next_round_waits_for_it(tmp_path):
    resources = _resources(tmp_path, source="production", steps=1, batch_size=2)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        canary = _open(tables, 1)
        instance.add_dynamic_partitions("rounds", ["r000001"])
        for asset in ("advantages", "deployment"):  # round 1 deployed: its canary opened
            instance.report_runless_asset_event(AssetMaterialization(asset, partition="r000001"))
        tids = _canary_traffic(tables, canary, 6)
        tables.append("landing_feedback", [_feedback(t) for t in tids])
        with build_sensor_context(instance=instance, resources=resources) as ctx:
            assert round_sensor()(ctx).skip_message == "round 1's canary is not decided yet"

        with pytest.raises(Failure, match="names its operator and its reason"):
            _run(instance, resources, round=1, decision="promote", operator="alice")
        (check,) = _run(
            instance, resources, round=1, decision="roll_back", operator="alice", reason="support tickets up"
        )
        assert not check.passed
        assert check.description.startswith("roll_back by alice: support tickets up (the rule: waiting")
        assert check.metadata["decided_by"].value == "alice"
        row = canaries.of_round(canaries.canaries(tables), "main-r000001")
        assert (row["status"], row["decided_by"]) == (canaries.ROLLED_BACK, "alice")
        assert json.loads(row["verdict_json"])["decision"] == "wait"  # what the rule said, kept
        assert live_deployment(tables)["deployment_id"] == "base"
        with pytest.raises(Failure, match="was decided already: rolled_back by alice"):
            _run(instance, resources, round=1, decision="promote", operator="bob", reason="changed my mind")
        with build_sensor_context(instance=instance, resources=resources) as ctx:
            assert round_sensor()(ctx).run_requests[0].partition_key == "r000002"  # decided: round 2 starts


def test_of_a_rule_run_and_an_override_that_both_read_open_exactly_one_decision_applies(gate):
    instance, resources, tables = gate
    canary = _open(tables, 1)
    tables.append("landing_feedback", [_feedback(t) for t in _canary_traffic(tables, canary, 40)])
    stale = canaries.of_round(canaries.canaries(tables), "main-r000001")  # what both runs read
    (check,) = _run(instance, resources, round=1, decision="roll_back", operator="bob", reason="tickets")
    assert not check.passed
    with pytest.raises(canaries.AlreadyDecided, match="decided already: rolled_back by bob"):
        canaries.settle(tables, stale, True, canaries.BY_RULE, "promoted: the rule", {})
    row = canaries.of_round(canaries.canaries(tables), "main-r000001")
    assert (row["status"], row["decided_by"]) == (canaries.ROLLED_BACK, "bob")
    assert live_deployment(tables)["deployment_id"] == "base"  # the losing promotion moved nothing
    assert canary_job.tags["prodrl/decision"] == "canary"  # instance.yaml runs these one at a time
    assert canary_job.tags["dagster/max_runtime"] == "900"  # a dead one cannot hold a promotion


def test_a_promotion_whose_run_died_after_its_claim_is_finished_by_the_next_run(gate):
    instance, resources, tables = gate
    canary = _open(tables, 1)
    canaries.close(tables, canary, canaries.PROMOTING, canaries.BY_RULE, "promoted: the rule", {})
    assert live_deployment(tables)["deployment_id"] == "base"  # its run is here, or died here
    deciding = create_run_for_test(instance, "canary_job", status=DagsterRunStatus.STARTED)  # by hand
    assert "is being promoted; canary_job run" in _tick(instance, resources).skip_message  # may finish
    deciding = instance.get_run_by_id(deciding.run_id)
    instance.add_run_tags(deciding.run_id, {CANARY_TAG: canary["canary_id"]})  # as the sensor's
    instance.report_run_failed(deciding)  # it died (run monitoring fails it past its max runtime)
    request = _tick(instance, resources)
    assert request.run_key == f"{canary['canary_id']}:finish:1"  # requested anew after the failed run
    config = request.run_config["ops"]["decide_canary"]["config"]
    (check,) = _run(instance, resources, **config)
    assert check.passed and check.description == "promoted: the rule"
    assert live_deployment(tables)["deployment_id"] == "main-r000001"
    assert canaries.of_round(canaries.canaries(tables), "main-r000001")["status"] == canaries.PROMOTED
    again = canary_job.execute_in_process(  # a sensor's run for it, queued meanwhile, ends quietly
        {"ops": {"decide_canary": {"config": config}}},
        instance=instance,
        resources=resources,
        tags=request.tags,
    )
    assert again.success and not again.get_asset_check_evaluations()
    with pytest.raises(Failure, match="was decided already"):  # one launched by hand says so
        _run(instance, resources, **config)


def test_a_canary_queued_behind_a_promoted_one_is_judged_against_the_new_live_and_can_pass(gate):
    instance, resources, tables = gate
    first = _open(tables, 1)
    queued = _open(tables, 2)  # async1: round 2 deployed while round 1's canary runs, against base
    assert queued["control_id"] == "base"
    tables.append("landing_feedback", [_feedback(t) for t in _canary_traffic(tables, first, 40)])
    (check,) = _run(instance, resources, round=1)
    assert check.passed and live_deployment(tables)["deployment_id"] == "main-r000001"
    active, _ = canaries.active(canaries.canaries(tables))
    assert (active["canary_id"], active["control_id"]) == (queued["canary_id"], "main-r000001")
    tids = _canary_traffic(tables, active, 40)  # the gateway serves the control arm from live
    tables.append("landing_feedback", [_feedback(t) for t in tids])
    (check,) = _run(instance, resources, round=2)
    assert check.passed and check.metadata["n_control"].value > 0
    assert live_deployment(tables)["deployment_id"] == "main-r000002"


def test_the_active_canary_follows_live_forward_only_whatever_moved_it(gate):
    """`sync` (each sensor tick, each job, after each decision) gives the active canary live as its
    control, even when the run that moved live died before doing so; a canary whose candidate can no
    longer go live (live is a later round) is closed, not judged."""
    instance, resources, tables = gate
    first, second, third = _open(tables, 1), _open(tables, 2), _open(tables, 3)
    with pytest.MonkeyPatch.context() as mp:  # the deciding run dies right after its decision
        mp.setattr(canaries, "sync", lambda store: canaries.canaries(store))
        canaries.settle(tables, first, True, canaries.BY_RULE, "promoted: the rule", {})
    assert canaries.of_round(canaries.canaries(tables), "main-r000002")["control_id"] == "base"
    assert "waiting" in _tick(instance, resources).skip_message
    assert canaries.of_round(canaries.canaries(tables), "main-r000002")["control_id"] == "main-r000001"

    set_live(tables, "main-r000003")  # live moved past round 2 by other means (by hand)
    assert _tick(instance, resources).skip_message == "no open canary"
    row = canaries.of_round(canaries.canaries(tables), "main-r000002")
    assert (row["status"], row["control_id"]) == (canaries.ROLLED_BACK, "main-r000001")
    assert row["reason"] == "not judged: live is main-r000003 (round 3), and live only moves forward"
    third = canaries.of_round(canaries.canaries(tables), "main-r000003")
    assert (third["status"], third["reason"]) == (
        canaries.ROLLED_BACK,
        "not judged: its candidate is live already",
    )
    assert second["canary_id"] == row["canary_id"]


def test_a_candidate_exported_again_supersedes_its_open_canary_and_waits_for_a_promoting_one(gate):
    instance, resources, tables = gate
    canary = _open(tables, 1)
    canaries.supersede(tables, "main-r000001")
    row = canaries.of_round(canaries.canaries(tables), "main-r000001")
    assert (row["status"], row["reason"]) == (
        canaries.ROLLED_BACK,
        "superseded: the candidate was exported again",
    )
    again = _open(tables, 1)
    assert again["canary_id"] == "main-r000001.2" != canary["canary_id"]
    canaries.close(tables, again, canaries.PROMOTING, canaries.BY_RULE, "promoted: the rule", {})
    with pytest.raises(canaries.CanaryBusy, match=r"canary main-r000001.2 of main-r000001 is being promoted"):
        canaries.supersede(tables, "main-r000001")
    with pytest.raises(Failure, match="is being promoted .* decided already; canary_job with decision rule"):
        _run(instance, resources, round=1, decision="roll_back", operator="alice", reason="no")
    (check,) = _run(instance, resources, round=1)  # the rule finishes it
    assert check.passed and live_deployment(tables)["deployment_id"] == "main-r000001"
