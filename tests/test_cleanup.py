"""The cleanup job: on the local S3 server its dry run lists exactly the artifact versions and
download-cache entries no registry row names (a re-run's older upload, an upload that never
completed, a write never registered, copies of those, a download that stopped) and deletes
nothing; the real run deletes exactly those. Locally: the folders a killed write left."""

import os
from pathlib import Path

import pytest
from dagster import instance_for_test

from assets.operations import cleanup_job
from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.cleanup import remove, unreferenced
from prodrl_pipeline.records.registry import register_checkpoint, register_deployment
from resources.store import StoreResource
from tests.s3 import BUCKET, s3_client, s3_server


@pytest.fixture
def s3(tmp_path):
    with s3_server(tmp_path / "moto.log") as options:
        yield options


def _write(artifacts: Artifacts, *parts: str) -> str:
    """A version of the folder `parts` (a new upload on S3); its registrable URI."""
    with artifacts.writing(artifacts.uri(*parts)) as upload:
        (upload.folder / "model.safetensors").write_bytes(os.urandom(256))
        (upload.folder / "config.json").write_text("{}")
    return upload.uri


def _register(tables, kind: str, name: str, path: str) -> None:
    if kind == "checkpoints":
        register_checkpoint(
            tables, checkpoint_id=name, round_=0, experiment="main", parent_id=None, path=path, step=0
        )
    else:
        register_deployment(
            tables,
            deployment_id=name,
            round_=0,
            checkpoint_id=name,
            path=path,
            quant_format="nvfp4",
            sampling_json="{}",
        )


def _cleanup(instance, store: StoreResource, **config) -> dict:
    """One run of cleanup_job; its op's output metadata as plain values."""
    result = cleanup_job.execute_in_process(
        instance=instance,
        resources={"store": store},
        run_config={"ops": {"unreferenced_artifacts": {"config": config}}},
    )
    (output,) = [e for e in result.all_node_events if e.is_successful_output]
    return {k: v.value for k, v in output.step_output_data.metadata.items()}


def test_the_cleanup_job_lists_then_deletes_exactly_what_no_registry_row_names_on_s3(tmp_path, s3):
    store = StoreResource(
        root=str(tmp_path),
        tables_uri=f"s3://{BUCKET}/tables",
        artifacts_uri=f"s3://{BUCKET}/artifacts",
        storage_options=s3,
    )
    artifacts, tables, client = store.artifacts(), store.tables(), s3_client(s3)
    base = _write(artifacts, "checkpoints", "base")
    first = _write(artifacts, "checkpoints", "main", "r000001")  # round 1's first run
    rerun = _write(artifacts, "checkpoints", "main", "r000001")  # its re-run, which the registry names
    export = _write(artifacts, "deployments", "main", "r000001")
    _register(tables, "checkpoints", "base", base)
    _register(tables, "checkpoints", "main-r000001", rerun)
    _register(tables, "deployments", "main-r000001", export)
    never_registered = _write(artifacts, "deployments", "main", "r000002")  # killed before registering it
    stopped_upload = f"artifacts/deployments/main/r000001/{'f' * 32}"  # stopped before its manifest
    client.put_object(Bucket=BUCKET, Key=f"{stopped_upload}/model.safetensors", Body=b"x")
    incomplete = f"s3://{BUCKET}/{stopped_upload}"
    named_copy, stale_copy = artifacts.local(rerun), artifacts.local(first)  # the download cache
    stopped = artifacts.cache / f"{artifacts.cache_folder(export).name}.k2j4h1"  # a download that stopped
    stopped.mkdir()
    (stopped / "model.safetensors").write_bytes(b"part")
    garbage = {first, incomplete, never_registered, str(stale_copy), str(stopped)}

    def objects() -> set[str]:  # not the empty "folder" markers pyarrow leaves for a deleted folder's parent
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix="artifacts/")["Contents"]
        return {o["Key"] for o in listed if not (o["Key"].endswith("/") and o["Size"] == 0)}

    before, cached = objects(), set(artifacts.cache.iterdir())
    with instance_for_test() as instance:
        young = _cleanup(instance, store)  # the default keeps the last day's: nothing here is old enough
        assert young["collected"] == [] and set(young["recent"]) == garbage
        dry = _cleanup(instance, store, min_age_hours=0)
        assert dry["dry_run"] and set(dry["collected"]) == garbage and len(dry["collected"]) == len(garbage)
        assert dry["recent"] == [] and dry["collected_bytes"] > 0
        assert objects() == before and set(artifacts.cache.iterdir()) == cached  # a dry run deletes nothing
        for uri in garbage:
            assert uri in dry["unreferenced"]  # the table the run's page shows

        done = _cleanup(instance, store, min_age_hours=0, delete=True)
        assert not done["dry_run"] and set(done["collected"]) == garbage
    left = objects()
    gone = {k for k in before if any(k.startswith(u.removeprefix(f"s3://{BUCKET}/") + "/") for u in garbage)}
    assert left == before - gone and gone  # exactly the unreferenced versions' objects
    assert set(artifacts.cache.iterdir()) == {named_copy}
    fresh = Artifacts(f"s3://{BUCKET}/artifacts", s3, tmp_path / "another-machine")
    for uri in (base, rerun, export):
        assert (fresh.local(uri) / "model.safetensors").stat().st_size == 256  # what is named still loads
    with instance_for_test() as instance:
        assert _cleanup(instance, store, min_age_hours=0)["collected"] == []


def test_local_folders_a_killed_write_left_are_unreferenced_and_lock_files_stay(tmp_path):
    artifacts = StoreResource(root=str(tmp_path)).artifacts()
    named = _write(artifacts, "checkpoints", "main", "r000001")
    left = {
        Path(named).parent / ".tmp-r000001-3kq9",  # killed while it wrote
        Path(named).parent / ".old-r000001-5d0c1e2f",  # killed between the two renames of a swap
        Path(named).parent / "r000002",  # written, never registered
    }
    for folder in left:
        (folder / "weights").parent.mkdir(parents=True)
        (folder / "weights").write_text("w")
    lock = Path(named).parent / ".r000001.lock"
    lock.touch()
    found = unreferenced(artifacts, [named])
    assert {u.uri for u in found} == {str(f) for f in left} and {u.kind for u in found} == {"checkpoints"}
    remove(artifacts, found)
    assert sorted(p.name for p in Path(named).parent.iterdir()) == [".r000001.lock", "r000001"]
