"""Object storage: a round runs with every table, checkpoint and export on a local S3-compatible
server (moto, started by the test on loopback), and the live pointer's compare-and-set holds there
(deltalake commits with conditional writes: no lock service)."""

import json

import pytest
from dagster import AssetKey, instance_for_test

from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.records.registry import BASE, live_deployment, lookup, move_live, set_live
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.checkpoint import META_FILE
from resources.lab import LabResource
from resources.store import StoreResource
from tests.postgres import postgres_server
from tests.s3 import BUCKET, s3_client, s3_server
from tests.test_pipeline import TINY, run_rounds


@pytest.fixture
def s3(tmp_path):
    with s3_server(tmp_path / "moto.log") as options:
        yield options


def test_a_round_runs_on_s3_and_postgres_with_torchrun_training(tmp_path, s3):
    """Everything a scaled-out deployment keeps elsewhere: Dagster on PostgreSQL, the tables and
    the checkpoints and exports on S3, training in two torchrun processes launched through Pipes."""
    store = StoreResource(
        root=str(tmp_path),
        tables_uri=f"s3://{BUCKET}/tables",
        artifacts_uri=f"s3://{BUCKET}/artifacts",
        storage_options=s3,
    )
    resources = {"store": store, "lab": LabResource(**TINY, trainer_processes=2)}
    with (
        postgres_server() as db,
        instance_for_test(overrides={"storage": {"postgres": {"postgres_db": db}}}) as instance,
    ):
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        run_rounds(instance, resources, (1,))
        meta = instance.get_latest_materialization_event(
            AssetKey("checkpoint")
        ).asset_materialization.metadata
    assert meta["trainer_processes"].value == 2 and meta["path"].value.startswith(f"s3://{BUCKET}/artifacts/")
    tables = DeltaStore(f"s3://{BUCKET}/tables", storage_options=s3)
    assert tables.read("trajectories", 1).num_rows == TINY["steps"] * TINY["batch_size"]
    assert tables.read("train_steps", 1).num_rows == TINY["steps"]
    assert live_deployment(tables)["deployment_id"] == "main-r000001"
    ckpt = lookup(tables, "checkpoints", "checkpoint_id", "main-r000001")
    dep = lookup(tables, "deployments", "deployment_id", "main-r000001")
    assert ckpt["path"].startswith(f"s3://{BUCKET}/artifacts/checkpoints/main/r000001/")
    assert dep["path"].startswith(f"s3://{BUCKET}/artifacts/deployments/main/r000001/")
    listed = s3_client(s3).list_objects_v2(Bucket=BUCKET, Prefix=dep["path"].removeprefix(f"s3://{BUCKET}/"))
    assert {o["Key"].rsplit("/", 1)[1] for o in listed["Contents"]} >= {
        "model.safetensors",
        "hf_quant_config.json",
    }
    # nothing else local: downloaded copies, and the round locks (they guard runs on this machine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "locks", "moto.log"]
    fresh = Artifacts(f"s3://{BUCKET}/artifacts", s3, tmp_path / "other-cache")  # another machine's view
    saved = json.loads((fresh.local(ckpt["path"]) / META_FILE).read_text())
    assert saved["data_parallel"] == 2 and saved["parent_id"] == BASE

    moved_by_other = []

    def decide(live: dict) -> bool:  # another writer moves live back to base while this one decides
        if not moved_by_other:
            moved_by_other.append(set_live(tables, "base"))
        return live["deployment_id"] == "main-r000001"

    assert not move_live(tables, "main-r000001", decide)  # the stale decision's commit was refused
    assert live_deployment(tables)["deployment_id"] == "base"


def test_artifacts_are_immutable_versions_readable_once_complete(tmp_path, s3):
    artifacts = Artifacts(f"s3://{BUCKET}/a", s3, tmp_path / "cache")
    uri = artifacts.uri("checkpoints", "r1")
    assert uri == f"s3://{BUCKET}/a/checkpoints/r1"
    with pytest.raises(RuntimeError, match="interrupted"), artifacts.writing(uri) as upload:
        (upload.folder / "weights").write_text("partial")
        raise RuntimeError("interrupted")
    assert "Contents" not in s3_client(s3).list_objects_v2(Bucket=BUCKET, Prefix="a/")  # nothing uploaded
    with artifacts.writing(uri) as first:
        (first.folder / "weights").write_text("v1")
        (first.folder / "sub").mkdir()
        (first.folder / "sub" / "more").write_text("nested")
    assert first.uri.startswith(uri + "/") and first.uri != uri
    copy = artifacts.local(first.uri)
    assert (copy / "weights").read_text() == "v1" and (copy / "sub" / "more").read_text() == "nested"
    assert artifacts.local(first.uri) == copy  # downloaded once
    with artifacts.writing(uri) as second:  # a re-run writes a new version beside the first
        (second.folder / "weights").write_text("v2")
    assert (artifacts.local(second.uri) / "weights").read_text() == "v2"
    assert (
        Artifacts(f"s3://{BUCKET}/a", s3, tmp_path / "fresh").local(first.uri) / "weights"
    ).read_text() == "v1"
    client, key = s3_client(s3), second.uri.removeprefix(f"s3://{BUCKET}/")
    client.delete_object(Bucket=BUCKET, Key=f"{key}/.manifest.json")  # as if the upload had stopped there
    with pytest.raises(FileNotFoundError, match="never completed"):
        Artifacts(f"s3://{BUCKET}/a", s3, tmp_path / "other").local(second.uri)
    client.put_object(Bucket=BUCKET, Key=f"{key}/.manifest.json", Body=b'{"files": {"../../escape": 2}}')
    with pytest.raises(ValueError, match="outside the folder"):  # a hostile manifest
        Artifacts(f"s3://{BUCKET}/a", s3, tmp_path / "third").local(second.uri)
    with pytest.raises(ValueError, match="only local folders and s3://"):
        Artifacts("gs://bucket/prefix")
