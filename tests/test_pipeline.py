"""The real round graph on a real Dagster instance and real Delta tables, at tiny settings."""

from dagster import AssetKey, Definitions, instance_for_test, materialize

from assets.advantages import advantages
from assets.base_model import base_model
from assets.checkpoint import checkpoint
from assets.definitions import defs
from assets.deployment import deployment
from assets.eval_report import eval_report
from assets.partitions import round_key
from assets.trajectories import trajectories
from prodrl_pipeline.records.registry import lookup
from resources.lab import LabResource
from resources.store import StoreResource

ASSETS = [base_model, trajectories, advantages, checkpoint, deployment, eval_report]
ROUND = [trajectories, advantages, checkpoint, deployment, eval_report]


def _resources(root):
    lab = LabResource(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        steps=2,
        batch_size=8,
        eval_puzzles=16,
    )
    return {"store": StoreResource(root=str(root)), "lab": lab}


def test_definitions_load():
    Definitions.validate_loadable(defs)
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"base_job", "round_job"}


def test_two_rounds_end_to_end(tmp_path):
    resources = _resources(tmp_path)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        assert tables.live_deployment()["deployment_id"] == "base"
        for k in (1, 2):
            instance.add_dynamic_partitions("rounds", [round_key(k)])
            result = materialize(
                ASSETS, selection=ROUND, partition_key=round_key(k), instance=instance, resources=resources
            )
            assert result.success

        # lineage is data: round 2 was served by round 1's deployment, and the chain leads to base
        assert set(tables.read("trajectories", 2).column("deployment_id").to_pylist()) == {"main-r000001"}
        assert lookup(tables, "checkpoints", "checkpoint_id", "main-r000002")["parent_id"] == "main-r000001"
        assert lookup(tables, "checkpoints", "checkpoint_id", "main-r000001")["parent_id"] == "base"
        assert tables.live_deployment()["deployment_id"] == "main-r000002"
        # optimizer steps continue across rounds: one long run
        assert sorted(tables.read("train_steps").column("step").to_pylist()) == [1, 2, 3, 4]
        assert sorted(set(tables.read("eval_results").column("round").to_pylist())) == [0, 1, 2]
        meta = instance.get_latest_materialization_event(
            AssetKey("eval_report")
        ).asset_materialization.metadata
        assert "reward_curve" in meta and "heldout_solve_rate" in meta

        counts = {t: tables.read(t).num_rows for t in ("calls", "trajectories", "advantages")}
        ids = sorted(tables.read("trajectories", 1).column("trajectory_id").to_pylist())
        assert materialize(
            ASSETS,
            selection=[trajectories, advantages],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
        ).success
        assert {t: tables.read(t).num_rows for t in counts} == counts  # re-materializing never duplicates
        assert sorted(tables.read("trajectories", 1).column("trajectory_id").to_pylist()) == ids  # immutable
        recollect = {"ops": {"trajectories": {"config": {"recollect": True}}}}
        assert materialize(
            ASSETS,
            selection=[trajectories],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
            run_config=recollect,
        ).success
        assert {t: tables.read(t).num_rows for t in counts} == counts
