"""The dead-run sensor on a real Dagster instance: a started run whose process is gone (a round lock
names it, and every process it ran in is gone on this host) is marked failed, naming that process;
a run whose process lives, or that another host holds, is left alone."""

import json
import os
import socket
import subprocess
import sys

from dagster import DagsterEventType, DagsterRunStatus, build_sensor_context, instance_for_test
from dagster._core.events import EngineEventData
from dagster._core.test_utils import create_run_for_test

from assets.dead_runs import DIED_TAG, dead_run_sensor
from prodrl_pipeline.locks import Holder
from resources.store import StoreResource

HOLD = """
import sys
from pathlib import Path
from prodrl_pipeline.locks import holding
with holding(Path(sys.argv[1]), f"run {sys.argv[2]}", "step checkpoint"):
    print("held", flush=True)
    if sys.argv[3] == "hold":
        sys.stdin.read()  # holds until the parent closes stdin or kills it
"""


def _hold(lock, run_id: str, until: str = "hold") -> subprocess.Popen:
    """A process holding `lock` as run `run_id`'s step (until killed, or `until` != "hold": it lets
    go and ends, as a step process of a multiprocess executor does)."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock), run_id, until], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdout.readline().strip() == b"held"
    return child


def test_a_started_run_whose_process_is_gone_is_marked_failed_naming_it(tmp_path):
    store = StoreResource(root=str(tmp_path))
    lock = lambda key: tmp_path / "locks" / "main" / f"{key}.lock"  # noqa: E731
    with instance_for_test() as instance:
        run = {
            k: create_run_for_test(
                instance, "round_job", status=DagsterRunStatus.STARTED, tags={"dagster/partition": k}
            ).run_id
            for k in ("r000001", "r000002", "r000003", "r000004")
        }
        killed, alive = _hold(lock("r000001"), run["r000001"]), _hold(lock("r000002"), run["r000002"])
        try:
            # r000003: its step process let go and ended, the run's own process (the test) lives
            _hold(lock("r000003"), run["r000003"], until="done").wait()
            instance.report_engine_event(
                "Executing steps using multiprocess executor: parent process",
                instance.get_run_by_id(run["r000003"]),
                EngineEventData.multiprocess(os.getpid()),
            )
            killed.kill()  # SIGKILL: the run stays "Started"
            killed.wait()
            # r000004: held on another machine (its pid is gone here), which only that machine can judge
            other = Holder(f"run {run['r000004']}", "step checkpoint", killed.pid, "elsewhere", "2026-12-01")
            lock("r000004").write_text(json.dumps(other._asdict()))

            def tick() -> str:
                with build_sensor_context(instance=instance, resources={"store": store}) as context:
                    return dead_run_sensor()(context).skip_message

            message = tick()
            status = {k: instance.get_run_by_id(r).status for k, r in run.items()}
            assert status == {
                "r000001": DagsterRunStatus.FAILURE,
                "r000002": DagsterRunStatus.STARTED,
                "r000003": DagsterRunStatus.STARTED,
                "r000004": DagsterRunStatus.STARTED,
            }
            process = f"pid {killed.pid} on {socket.gethostname()}"
            assert message.startswith(
                f"run {run['r000001']}: its process ({process}) is gone, it died in step checkpoint of "
                "round r000001 of main (lock taken "
            )
            assert message.endswith("UTC). Marked failed by dead_run_sensor, so that its round can run again")
            dead = instance.get_run_by_id(run["r000001"])
            assert dead.tags[DIED_TAG] == process and dead.tags["dagster/max_retries"] == "0"
            (failure,) = instance.all_logs(dead.run_id, of_type=DagsterEventType.RUN_FAILURE)
            assert failure.dagster_event.message == message  # what the run's page says
            assert tick() == "no started run's process is gone"
        finally:
            for child in (killed, alive):
                child.kill()
                child.wait()
