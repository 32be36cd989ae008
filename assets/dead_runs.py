"""Runs whose process is gone, marked failed so that their round runs again.

A started run whose process died (SIGKILL, OOM, a lost machine or container) stays "Started": the
default run launcher cannot check a run's process, so Dagster's run monitoring cannot see it (the
code server notices a run worker of its own that dies, not one that dies with it, nor a run
executed elsewhere: `materialize`, `dagster asset materialize`). Such a run still counts against the
run queue's per-round limit, keeps its `trainer` pool slot and keeps the round sensor waiting.
`dead_run_sensor` finds it through the round locks, which record each holder's pid and host."""

from __future__ import annotations

from collections.abc import Mapping

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from assets.partitions import lock_owner
from prodrl_pipeline.locks import Holder
from resources.store import StoreResource

DIED_TAG = "prodrl/died"
"""Set on a run this sensor marked failed: the process that died, `pid P on HOST`."""
RETRIES_TAG = "dagster/max_retries"
"""Set to 0 on it too: the round sensor runs its round again, Dagster's run retry must not as well."""


def dead_run_sensor(minimum_interval_seconds: int = 30) -> SensorDefinition:
    """The dead-run sensor, on by default, evaluated by the daemon at most every
    `minimum_interval_seconds`."""
    return sensor(
        name="dead_run_sensor",
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="Marks failed each started run whose process is gone (from the round locks)",
    )(fail_dead_runs)


def fail_dead_runs(context: SensorEvaluationContext, store: StoreResource) -> SkipReason:
    """One tick: `fail_dead` over this machine's round locks; the tick shows what it marked."""
    messages = fail_dead(context.instance, store.round_holders())
    return SkipReason("\n".join(messages) or "no started run's process is gone")


def fail_dead(instance: DagsterInstance, holders: Mapping[tuple[str, str], Holder]) -> list[str]:
    """Marks failed each started run whose process has ended: the round locks name it (holding
    one, or released by a step it finished; `holders` maps (experiment, round key) to the record)
    and every process it ran in, the pids its records and Dagster's engine events give, is gone on
    this host. Each such run is tagged `DIED_TAG` and failed with a message naming the process and
    where it died; returns the messages."""
    started = {r.run_id for r in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED]))}
    named: dict[str, list[tuple[str, str, Holder]]] = {}
    for (experiment, key), holder in holders.items():
        run_id = holder.owner.removeprefix("run ")
        if holder.owner == lock_owner(run_id) and run_id in started:
            named.setdefault(run_id, []).append((experiment, key, holder))
    messages = []
    for run_id, held in named.items():
        experiment, key, last = max(held, key=lambda h: h[2].since)  # where it was when it died
        if any(_may_run(last, h.pid) for _, _, h in held):
            continue
        if any(_may_run(last, pid) for pid in _engine_pids(instance, run_id)):  # the run's own process
            continue
        run = instance.get_run_by_id(run_id)
        if run is None or run.status != DagsterRunStatus.STARTED:  # it ended by itself meanwhile
            continue
        process = f"pid {last.pid} on {last.host}"
        message = (
            f"run {run_id}: its process ({process}) is gone, it died {'after' if last.released else 'in'} "
            f"{last.task} of round {key} of {experiment} (lock taken {last.since} UTC). Marked failed by "
            "dead_run_sensor, so that its round can run again"
        )
        instance.add_run_tags(run_id, {DIED_TAG: process, RETRIES_TAG: "0"})
        instance.report_run_failed(run, message)
        messages.append(message)
    return messages


def _may_run(holder: Holder, pid: int) -> bool:
    """Whether process `pid` on the holder's host may still run (another host cannot tell)."""
    return not holder._replace(pid=pid).gone()


def _engine_pids(instance: DagsterInstance, run_id: str) -> set[int]:
    """The pids Dagster's engine events give for the run's own process (its run worker; with a
    multiprocess executor, the parent of its step processes, which hold the locks)."""
    pids = set()
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        event = entry.dagster_event
        pid = event.engine_event_data.metadata.get("pid") if event and event.step_key is None else None
        if pid is not None:
            pids.add(int(pid.value))
    return pids
