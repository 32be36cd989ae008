from dagster import instance_for_test, materialize

from assets.base_model import base_model
from assets.operations import eval_live_job, maintenance_job
from tests.test_pipeline import _resources


def test_maintenance_compacts_and_checkpoints_and_eval_live_rewrites_the_live_eval(tmp_path):
    resources = _resources(tmp_path)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        for i in range(4):  # several small appends: several files
            tables.append(
                "landing_feedback",
                [
                    {
                        "feedback_id": f"f{i}",
                        "trajectory_id": f"t{i}",
                        "reward": 1.0,
                        "comment": None,
                        "overwrite": False,
                        "received_at": tables.read("deployments").column("created_at")[0].as_py(),
                    }
                ],
            )
        files_before = len(tables.table("landing_feedback").file_uris())
        assert maintenance_job.execute_in_process(instance=instance, resources=resources).success
        dt = tables.table("landing_feedback")
        assert files_before == 4 and len(dt.file_uris()) == 1
        assert (tmp_path / "tables" / "landing_feedback" / "_delta_log" / "_last_checkpoint").exists()
        assert tables.read("landing_feedback").num_rows == 4  # nothing lost

        rows = [{**r, "solved": True} for r in tables.read("eval_results", 0).to_pylist()]
        tables.overwrite("eval_results", rows, "round = 0 AND deployment_id = 'base'")
        assert eval_live_job.execute_in_process(instance=instance, resources=resources).success
        fresh = tables.read("eval_results", 0).to_pylist()
        assert len(fresh) == len(rows) and not all(r["solved"] for r in fresh)  # re-evaluated, replaced


def test_the_lab_instance_config_has_retries_the_trainer_pool_and_one_run_per_round(tmp_path, monkeypatch):
    import shutil

    from dagster import DagsterInstance

    shutil.copy("instance.yaml", tmp_path / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with DagsterInstance.get() as instance:
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 1
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
        per_round = {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}
        assert per_round in limits  # queued runs of one round partition run one at a time
        # the daemon frees the pool slots a run kept once it is failed (a killed run's: dead_run_sensor)
        assert instance.run_monitoring_enabled
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] > 0
