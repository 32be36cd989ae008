"""Runs submitted to the instance as the UI submits them, launched by the daemon, followed to the end.

`make demo` uses this so that its runs are the instance's own: they pass through the run queue
(its per-round limit and retries), appear in the UI's timeline, the job's runs and each asset's
history, and the progress shown is read back from the run's event log.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter
from dagster._core.definitions.selector import JobSubsetSelector
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, WILL_RETRY_TAG
from dagster._core.workspace.context import WorkspaceProcessContext, WorkspaceRequestContext
from dagster._core.workspace.load_target import WorkspaceFileTarget

FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
RETRY_WAIT_S = 60
"""How long a failed run's decision to retry (instance `run_retries`) is waited for."""
STALL_S = 600
"""A run with no new event for this long is reported (its process may have died)."""
IN_FLIGHT = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]


PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, however
    it dies, so a killed demo leaves no daemon behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT to the process group (as Ctrl-C), SIGKILL after `grace_s` or on a second Ctrl-C."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def daemon(workspace: str, log: Path) -> Iterator[subprocess.Popen]:
    """`dagster-daemon run` for the block (it dequeues submitted runs and launches them), its
    output in `log`; stopped at the block's end, and terminated by the kernel if this process dies
    first."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", workspace],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
        )
    try:
        yield proc
    finally:
        stop(proc, grace_s=30)


def in_flight(instance: DagsterInstance) -> list:
    """Runs of the instance that are queued or running."""
    return instance.get_runs(RunsFilter(statuses=IN_FLIGHT))


def cancel(instance: DagsterInstance, run_id: str) -> None:
    """Cancel a run as the UI's Terminate does (a queued run is dequeued; a running one is asked to
    stop, and ends CANCELED, which is not retried)."""
    instance.run_coordinator.cancel_run(run_id)


@contextmanager
def workspace(instance: DagsterInstance, path: str) -> Iterator[WorkspaceRequestContext]:
    """The code locations of `workspace.yaml`, loaded once (as `dagster job launch` loads them)."""
    target = WorkspaceFileTarget(paths=[path])
    with WorkspaceProcessContext(instance, target, code_server_log_level="WARNING") as process:
        context = process.create_request_context()
        for error in context.code_location_errors():
            raise RuntimeError(f"the code location failed to load: {error.to_string()}")
        yield context


def submit(
    instance: DagsterInstance,
    context: WorkspaceRequestContext,
    job: str,
    tags: Mapping[str, str] | None = None,
    run_config: Mapping | None = None,
) -> str:
    """Create a run of `job` (tags `{"dagster/partition": key}` select a round) and submit it to
    the instance's run coordinator, as the UI's Launch button does; returns its run id."""
    location = context.get_code_location(context.code_location_names[0])
    (repository,) = location.get_repositories().values()
    remote_job = location.get_job(
        JobSubsetSelector(
            location_name=location.name, repository_name=repository.name, job_name=job, op_selection=None
        )
    )
    plan = location.get_execution_plan(
        remote_job, dict(run_config or {}), step_keys_to_execute=None, known_state=None, instance=instance
    ).execution_plan_snapshot
    run = instance.create_run(
        job_name=job,
        run_id=None,
        run_config=dict(run_config or {}),
        resolved_op_selection=None,
        step_keys_to_execute=plan.step_keys_to_execute,
        op_selection=None,
        status=None,
        root_run_id=None,
        parent_run_id=None,
        tags=dict(tags or {}),
        job_snapshot=remote_job.job_snapshot,
        execution_plan_snapshot=plan,
        parent_job_snapshot=remote_job.parent_job_snapshot,
        remote_job_origin=remote_job.get_remote_origin(),
        job_code_origin=remote_job.get_python_origin(),
        asset_selection=None,
        asset_check_selection=None,
        asset_graph=repository.asset_graph,
    )
    return instance.submit_run(run.run_id, context).run_id


def follow(
    instance: DagsterInstance,
    run_id: str,
    show: Callable[[str], None],
    alive: Callable[[], bool],
    poll_s: float = 0.5,
) -> str:
    """Wait for run `run_id` to finish, showing its status changes, its steps and the assets'
    log messages as they land in the event log (and a wait for the trainer pool); a failed run is
    followed into its automatic retry when the instance decides on one (`dagster/will_retry`,
    `dagster/auto_retry_run_id`). Returns the id of the run that finished last. `alive()` false
    (the daemon exited) ends the wait with an error; a run with no news for `STALL_S` is reported."""
    cursor, status, retry_deadline, quiet_since = None, None, None, time.monotonic()
    while True:
        run = instance.get_run_by_id(run_id)  # before the events: none is missed at its end
        changed = run.status != status
        status = run.status
        if changed and status not in FINISHED:  # a start before the steps, an end after them
            show(f"run {run_id[:8]} {status.value.lower()}")
        page = instance.get_records_for_run(run_id, cursor=cursor)
        cursor = page.cursor
        for record in page.records:
            line = _line(record.event_log_entry)
            if line:
                show(line)
        if changed and status in FINISHED:
            show(f"run {run_id[:8]} {status.value.lower()}")
        if changed or page.records:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > STALL_S:
            show(
                f"run {run_id[:8]} is {status.value.lower()} with no news for {STALL_S // 60} min: if its "
                "process died, terminate it (make ui: Runs, the run, Terminate); still waiting"
            )
            quiet_since = time.monotonic()
        if status in FINISHED and not page.has_more:
            if status != DagsterRunStatus.FAILURE:
                return run_id
            retry = run.tags.get(AUTO_RETRY_RUN_ID_TAG)
            if retry:
                show(f"run {run_id[:8]} failed; following its automatic retry {retry[:8]}")
                run_id, cursor, status, retry_deadline = retry, None, None, None
                continue
            retry_deadline = retry_deadline or time.monotonic() + RETRY_WAIT_S
            if run.tags.get(WILL_RETRY_TAG) == "false" or time.monotonic() > retry_deadline:
                return run_id
        if not alive():
            raise RuntimeError("the Dagster daemon exited; its log says why")
        time.sleep(poll_s)  # polling the instance's run storage, as the UI does


def _line(entry) -> str | None:
    """One progress line for an event: step starts and ends, failures, the assets' own messages."""
    step = entry.step_key or ""
    event = entry.dagster_event
    if event is None:
        return f"  {step}: {entry.user_message}" if entry.user_message else None
    if event.event_type == DagsterEventType.STEP_START:
        return f"  {step}: started"
    if event.event_type == DagsterEventType.STEP_SUCCESS:
        return f"  {step}: done in {event.event_specific_data.duration_ms / 1000:.1f} s"
    if event.event_type in (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE):
        return f"  {step or 'run'}: FAILED {entry.message or ''}".rstrip()
    if event.event_type == DagsterEventType.ENGINE_EVENT and re.search(
        r"concurrency|slot|pool", entry.message or "", re.I
    ):
        return f"  {step or 'run'}: {entry.message}"  # waiting for the trainer pool, say
    if event.event_type == DagsterEventType.ASSET_CHECK_EVALUATION:
        check = event.event_specific_data
        return f"  {step}: check {check.check_name} {'passed' if check.passed else 'FAILED'}"
    return None
