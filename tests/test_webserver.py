"""`dagster dev -w workspace.yaml` loads the code location; its GraphQL API shows the graph and a
partition's materializations."""

import os
import signal
import subprocess
import sys
import time

import httpx
from dagster import DagsterInstance, materialize

from assets.base_model import base_model
from assets.partitions import round_key
from prodrl_pipeline.gateway.process import free_port
from tests.test_pipeline import ASSETS, ROUND, _resources

QUERY_GRAPH = "{ assetNodes { assetKey { path } isPartitioned } }"
QUERY_PARTITION = """{ assetOrError(assetKey: {path: ["eval_report"]}) {
  ... on Asset { assetMaterializations(partitions: ["r000001"], limit: 5) {
    runId partition metadataEntries { label } } } } }"""


def test_dagster_dev_serves_the_graph_and_materializations(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        resources = _resources(tmp_path / "store")
        with DagsterInstance.get() as instance:
            assert materialize([base_model], instance=instance, resources=resources).success
            instance.add_dynamic_partitions("rounds", [round_key(1)])
            result = materialize(
                ASSETS, selection=ROUND, partition_key=round_key(1), instance=instance, resources=resources
            )
            assert result.success
    finally:
        del os.environ["DAGSTER_HOME"]
    port = free_port()
    dev = subprocess.Popen(
        [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/graphql"
    try:
        deadline = time.monotonic() + 180
        while True:  # readiness probe: the code location is loaded when assets come back
            try:
                nodes = httpx.post(url, json={"query": QUERY_GRAPH}, timeout=5).json()["data"]["assetNodes"]
                if nodes:
                    break
            except (httpx.TransportError, KeyError, TypeError, ValueError):
                pass
            assert time.monotonic() < deadline and dev.poll() is None, "dagster dev did not come up"
            time.sleep(0.5)
        graph = {n["assetKey"]["path"][0]: n["isPartitioned"] for n in nodes}
        assert graph == {
            "base_model": False,
            "trajectories": True,
            "advantages": True,
            "checkpoint": True,
            "deployment": True,
            "eval_report": True,
            "study_report": False,  # the lab study's report (group `study`)
        }
        mats = httpx.post(url, json={"query": QUERY_PARTITION}, timeout=10).json()["data"]["assetOrError"]
        (mat,) = mats["assetMaterializations"]
        assert mat["partition"] == "r000001"
        assert {"heldout_solve_rate", "reward_curve", "rounds"} <= {
            e["label"] for e in mat["metadataEntries"]
        }
    finally:
        os.killpg(dev.pid, signal.SIGTERM)
        try:
            dev.wait(timeout=60)
        except subprocess.TimeoutExpired:  # dagster dev's children can outlive SIGTERM under load
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait(timeout=30)
