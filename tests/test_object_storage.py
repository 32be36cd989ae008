"""Delta tables on S3: a round runs with every table on a local S3-compatible server (moto,
started by the test on loopback), and the live pointer's compare-and-set holds there (deltalake
commits with conditional writes: no lock service)."""

import subprocess
import sys
import time

import boto3
import pytest
from botocore.exceptions import EndpointConnectionError
from dagster import instance_for_test

from prodrl_pipeline.gateway.process import free_port
from prodrl_pipeline.records.store import DeltaStore
from resources.lab import LabResource
from resources.store import StoreResource
from tests.test_pipeline import TINY, run_rounds

BUCKET = "prodrl-test"


@pytest.fixture
def s3(tmp_path):
    """moto's S3 server in its own process (in this one it would wait on the GIL that deltalake
    holds while it waits for the server's reply)."""
    port = free_port()
    with (tmp_path / "moto.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
        )
    options = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    client = boto3.client(
        "s3",
        endpoint_url=options["AWS_ENDPOINT_URL"],
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    deadline = time.monotonic() + 30
    while True:  # readiness probe
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except EndpointConnectionError:
            assert time.monotonic() < deadline and server.poll() is None, "moto's server did not start"
            time.sleep(0.1)
    yield options
    server.terminate()
    server.wait(timeout=30)


def test_a_round_runs_with_its_tables_on_s3(tmp_path, s3):
    store = StoreResource(root=str(tmp_path), tables_uri=f"s3://{BUCKET}/tables", storage_options=s3)
    resources = {"store": store, "lab": LabResource(**TINY)}
    with instance_for_test() as instance:
        run_rounds(instance, resources, (1,))
    tables = DeltaStore(f"s3://{BUCKET}/tables", storage_options=s3)
    assert tables.read("trajectories", 1).num_rows == TINY["steps"] * TINY["batch_size"]
    assert tables.read("train_steps", 1).num_rows == TINY["steps"]
    assert tables.live_deployment()["deployment_id"] == "main-r000001"
    assert not (tmp_path / "tables").exists()  # nothing fell back to the local folder

    moved_by_other = []

    def decide(live: dict) -> bool:  # another writer moves live back to base while this one decides
        if not moved_by_other:
            moved_by_other.append(tables.set_live("base"))
        return live["deployment_id"] == "main-r000001"

    assert not tables.move_live("main-r000001", decide)  # the stale decision's commit was refused
    assert tables.live_deployment()["deployment_id"] == "base"
