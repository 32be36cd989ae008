"""A round whose process is SIGKILLed heals without an operator. The Dagster daemon runs with the
round sensor on; round 1 runs in a process of its own (as `dagster asset materialize` runs one) and
is SIGKILLed while it trains, holding the `trainer` pool slot. Within a minute `dead_run_sensor`
marks the run failed, naming the process; the daemon frees the slot; the round sensor runs round 1
again, and once it is deployed starts round 2 by itself."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from dagster import AssetKey, DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter, materialize

from assets.base_model import base_model
from prodrl_pipeline.locks import holder
from resources.settings import resources_from_environment
from tests.test_pipeline import TINY

REPO = Path(__file__).resolve().parents[2]
ROUND_1 = """
from dagster import DagsterInstance
from assets.definitions import defs
with DagsterInstance.get() as instance:
    defs.resolve_job_def("round_job").execute_in_process(partition_key="r000001", instance=instance)
"""


def _until(what: str, deadline: float, check, daemon: subprocess.Popen):
    while not (value := check()):
        assert daemon.poll() is None, "the daemon exited"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)  # polling the instance's state, with a deadline
    return value


def test_a_round_killed_while_it_trains_is_failed_within_a_minute_and_the_sensor_carries_on(tmp_path):
    home, store = tmp_path / "dagster_home", tmp_path / "store"
    home.mkdir()
    shutil.copy(REPO / "instance.yaml", home / "dagster.yaml")
    settings = tmp_path / "settings.yaml"
    lab = {**TINY, "data_dir": str(REPO / "data")}
    settings.write_text(
        yaml.safe_dump({"lab": lab, "store": {"root": str(store)}, "sensor": {"minimum_interval_seconds": 1}})
    )
    env = {**os.environ, "DAGSTER_HOME": str(home), "PRODRL_SETTINGS": str(settings), "PYTHONPATH": str(REPO)}
    location = ["-w", str(REPO / "workspace.yaml")]
    instance = DagsterInstance.from_config(str(home))
    processes: list[subprocess.Popen] = []

    def start(command: list[str], log: str) -> subprocess.Popen:
        with (tmp_path / log).open("w") as out:
            process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True
            )
        processes.append(process)
        return process

    try:
        assert materialize([base_model], instance=instance, resources=resources_from_environment(env)).success
        instance.add_dynamic_partitions("rounds", ["r000001"])  # round 1 is in flight: the sensor waits
        child = start([sys.executable, "-c", ROUND_1], "round1.log")
        sensor_on = start(
            [sys.executable, "-m", "dagster", "sensor", "start", "round_sensor", *location], "cli.log"
        )
        daemon = start([str(Path(sys.executable).parent / "dagster-daemon"), "run", *location], "daemon.log")
        lock = store / "locks" / "main" / "r000001.lock"
        deadline = time.monotonic() + 300

        def training():  # round 1's record in its lock while it trains
            h = holder(lock)
            return h if h and h.task == "step checkpoint" and not h.released else None

        held = _until("round 1 to train", deadline, training, daemon)
        os.killpg(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert child.wait() == -signal.SIGKILL and held.pid == child.pid and held.host == socket.gethostname()
        (dead,) = instance.get_runs(RunsFilter(tags={"dagster/partition": "r000001"}))
        assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.STARTED  # what it was left as
        assert instance.event_log_storage.get_concurrency_info("trainer").active_run_ids == {dead.run_id}
        assert sensor_on.wait(timeout=120) == 0, (tmp_path / "cli.log").read_text()[-3000:]

        failed = lambda: instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.FAILURE  # noqa: E731
        _until("the dead run to be marked failed", killed + 60, failed, daemon)
        print(f"\nkilled in step checkpoint; marked failed {time.monotonic() - killed:.1f} s later")
        (event,) = instance.all_logs(dead.run_id, of_type=DagsterEventType.RUN_FAILURE)
        assert (
            f"its process (pid {child.pid} on {socket.gethostname()}) is gone" in event.dagster_event.message
        )
        assert "died in step checkpoint of round r000001 of main" in event.dagster_event.message

        def again() -> list:
            return instance.get_runs(RunsFilter(tags={"dagster/run_key": f"r000001-after-{dead.run_id}"}))

        (rerun,) = _until("the round sensor to run round 1 again", deadline, again, daemon)
        deployed = lambda: "r000001" in instance.get_materialized_partitions(AssetKey("deployment"))  # noqa: E731
        _until("round 1 to be deployed by its re-run", deadline, deployed, daemon)  # it trained: a free slot
        assert dead.run_id not in instance.event_log_storage.get_concurrency_info("trainer").active_run_ids
        second = lambda: instance.get_runs(RunsFilter(tags={"dagster/partition": "r000002"}))  # noqa: E731
        (round_2,) = _until("the round sensor to start round 2", deadline, second, daemon)
        assert round_2.tags["dagster/sensor_name"] == rerun.tags["dagster/sensor_name"] == "round_sensor"
        print(
            f"round 1 re-run and deployed, round 2 started {time.monotonic() - killed:.1f} s after the kill"
        )
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the daemon's group: its code server, run workers
            process.wait()
        instance.dispose()
