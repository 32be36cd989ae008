"""The round sensor on a real Dagster instance, over real landing tables."""

from datetime import UTC, datetime

from dagster import (
    AssetMaterialization,
    DagsterInstance,
    DagsterRunStatus,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from dagster._core.test_utils import create_run_for_test

from assets.base_model import base_model
from assets.dead_runs import DIED_TAG
from assets.sensors import round_sensor
from prodrl_pipeline.rounds import MAX_DEATHS
from tests.test_pipeline import _resources

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def _call(tid: str, deployment: str = "base") -> dict:
    return {
        "call_id": f"{tid}-c",
        "trajectory_id": tid,
        "call_index": 0,
        "deployment_id": deployment,
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [3],
        "completion_logprobs": [-0.5],
        "topk_token_ids": [[3]],
        "topk_logprobs": [[-0.5]],
        "support_size": [50],
        "support_token_ids": [[]],
        "extra_token_ids": [[]],
        "vocab_size": 50,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 4, "seed": 0},
        "finish_reason": "length",
        "messages_json": "[]",
        "created_at": NOW,
    }


def _feedback(tid: str) -> dict:
    return {
        "feedback_id": f"{tid}-f",
        "trajectory_id": tid,
        "reward": 1.0,
        "comment": None,
        "overwrite": False,
        "received_at": NOW,
    }


def _tick(instance: DagsterInstance, resources: dict, cursor: str | None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=resources) as ctx:
        return round_sensor()(ctx), ctx.cursor


def test_sensor_fires_once_per_threshold_crossing_and_never_for_unscored_traffic(tmp_path):
    resources = _resources(tmp_path, source="production", steps=2, batch_size=4)  # S*B = 8
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        result, cursor = _tick(instance, resources, None)
        assert not getattr(result, "run_requests", None)  # no traffic yet

        tables.append("landing_calls", [_call(f"t{i}") for i in range(20)])  # 20 calls, none scored
        tables.append("landing_calls", [_call(f"o{i}", deployment="other") for i in range(8)])
        tables.append("landing_feedback", [_feedback(f"o{i}") for i in range(8)])  # scored, other deployment
        result, cursor = _tick(instance, resources, cursor)
        assert not result.run_requests and "0/8" in result.skip_reason.skip_message

        tables.append("landing_feedback", [_feedback(f"t{i}") for i in range(7)])
        result, cursor = _tick(instance, resources, cursor)
        assert not result.run_requests and "7/8" in result.skip_reason.skip_message

        again, _ = _tick(instance, resources, cursor)  # nothing landed since: no query, no run
        assert not getattr(again, "run_requests", None)

        tables.append("landing_feedback", [_feedback("t7")])  # the 8th scored trajectory crosses S*B
        result, cursor = _tick(instance, resources, cursor)
        (request,) = result.run_requests
        assert request.partition_key == "r000001" and request.run_key == "r000001"
        # the round snapshots the deployment counted, even if live moves before the run starts
        assert request.run_config == {"ops": {"trajectories": {"config": {"deployment_id": "base"}}}}
        assert result.dynamic_partitions_requests[0].partition_keys == ["r000001"]
        instance.add_dynamic_partitions("rounds", ["r000001"])  # what the daemon does with the result

        tables.append("landing_feedback", [_feedback(f"t{i}") for i in range(8, 20)])
        result, _ = _tick(instance, resources, cursor)  # round 1 is in flight: no second launch
        assert not getattr(result, "run_requests", None)


def _taken(tid: str, round_: int) -> dict:
    return {
        "trajectory_id": tid,
        "round": round_,
        "deployment_id": "base",
        "task_id": None,
        "reward": 1.0,
        "n_calls": 1,
        "n_completion_tokens": 1,
        "started_at": NOW,
        "finished_at": NOW,
        "source": "production",
    }


def test_async1_starts_the_next_collection_while_the_previous_round_trains(tmp_path):
    resources = _resources(tmp_path, source="production", schedule="async1", steps=2, batch_size=4)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        tables.append("landing_calls", [_call(f"t{i}") for i in range(16)])
        tables.append("landing_feedback", [_feedback(f"t{i}") for i in range(15)])
        result, cursor = _tick(instance, resources, None)
        assert result.run_requests[0].partition_key == "r000001"
        instance.add_dynamic_partitions("rounds", ["r000001"])

        # round 1 has snapshotted t0..t7 but not computed its advantages: round 2 waits
        tables.overwrite_round("trajectories", [_taken(f"t{i}", 1) for i in range(8)], 1)
        result, cursor = _tick(instance, resources, cursor)
        assert not getattr(result, "run_requests", None) and "not taken its traffic" in result.skip_message

        # its advantages are stored: it queues for the trainer, and round 2 collects meanwhile from
        # what is still live (base): only 7 of the 8 untaken trajectories are scored
        instance.report_runless_asset_event(AssetMaterialization("trajectories", partition="r000001"))
        instance.report_runless_asset_event(AssetMaterialization("advantages", partition="r000001"))
        result, cursor = _tick(instance, resources, cursor)
        assert (
            not result.run_requests and "7/8 scored trajectories from base" in result.skip_reason.skip_message
        )
        tables.append("landing_feedback", [_feedback("t15")])
        result, cursor = _tick(instance, resources, cursor)
        assert result.run_requests[0].partition_key == "r000002"
        instance.add_dynamic_partitions("rounds", ["r000002"])

        # round 3 needs round 1 deployed, even once round 2 has taken its traffic
        instance.report_runless_asset_event(AssetMaterialization("advantages", partition="r000002"))
        result, _ = _tick(instance, resources, cursor)
        assert not getattr(result, "run_requests", None) and "round 1 is not deployed" in result.skip_message

        # round 1's run fails (say, in training): no round starts past it until it is re-run
        create_run_for_test(
            instance, "round_job", status=DagsterRunStatus.FAILURE, tags={"dagster/partition": "r000001"}
        )
        result, _ = _tick(instance, resources, cursor)
        assert "round 1's last run failed" in result.skip_message


def test_a_round_whose_run_died_runs_again_with_that_runs_config_once_per_death(tmp_path):
    resources = _resources(tmp_path, source="production", steps=2, batch_size=4)
    config = {"ops": {"trajectories": {"config": {"deployment_id": "base"}}}}
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        instance.add_dynamic_partitions("rounds", ["r000001"])

        def dies() -> str:  # a run of round 1 that dead_run_sensor marked failed
            tags = {"dagster/partition": "r000001", DIED_TAG: "pid 4242 on trainer-7"}
            return create_run_for_test(
                instance, "round_job", run_config=config, status=DagsterRunStatus.FAILURE, tags=tags
            ).run_id

        died = dies()
        result, _ = _tick(instance, resources, None)  # no traffic landed: the round runs again anyway
        (request,) = result.run_requests
        assert (request.partition_key, request.run_key) == ("r000001", f"r000001-after-{died}")
        assert request.run_config == config  # the traffic it counted, not what is live now
        assert not result.dynamic_partitions_requests

        for _ in range(MAX_DEATHS - 1):
            died = dies()
        result, _ = _tick(instance, resources, None)
        assert "round 1's last run failed" in result.skip_message  # died too often: an operator looks
