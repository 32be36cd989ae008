"""The round sensor: start the next round when the schedule allows it and, in production, enough
scored traffic of the live deployment has landed."""

from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.jobs import round_job
from assets.partitions import round_key, round_number, rounds
from prodrl_pipeline.records.snapshot import LANDING, count_available
from prodrl_pipeline.rounds import DEPLOYED, TRAFFIC_TAKEN, start_blocker
from resources.lab import LabResource
from resources.store import StoreResource


def round_sensor(minimum_interval_seconds: int = 30) -> SensorDefinition:
    """The round sensor, evaluated by the daemon at most every `minimum_interval_seconds`."""
    return sensor(
        name="round_sensor",
        job=round_job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.STOPPED,
    )(next_round)


def next_round(context: SensorEvaluationContext, store: StoreResource, lab: LabResource):
    """Adds partition r(k+1) and requests its run in one result, once `prodrl_pipeline.rounds`
    says round k+1 may start (sync: round k is deployed; async1: round k has taken its traffic and
    round k-1 is deployed) and, in production, once S*B scored trajectories served by the live
    deployment and not taken by a round have landed. The cursor is the landing tables' versions
    and live deployment counted (nothing new skips the query); the run key is the partition, so a
    re-evaluated tick never launches twice."""
    keys = sorted(context.instance.get_dynamic_partitions(rounds.name), key=round_number)
    latest = round_number(keys[-1]) if keys else 0
    done: dict[int, set[str]] = {}
    for asset in (TRAFFIC_TAKEN, DEPLOYED):
        for key in context.instance.get_materialized_partitions(AssetKey(asset)):
            done.setdefault(round_number(key), set()).add(asset)
    failed = [k for k in (latest - 1, latest) if k > 0 and _last_run_failed(context, round_key(k))]
    if blocker := start_blocker(lab.schedule, latest, done, failed):
        return SkipReason(blocker)
    tables = store.tables()
    live = tables.live_deployment()
    if live is None:
        return SkipReason("no live deployment: materialize base_model first")
    nxt = round_key(latest + 1)
    cursor = None
    if lab.source == "production":
        need = lab.steps * lab.batch_size
        versions = {t: tables.table(t).version() for t in LANDING if tables.exists(t)}
        cursor = f"{nxt}|{live['deployment_id']}|" + ",".join(f"{t}={v}" for t, v in sorted(versions.items()))
        if cursor == context.cursor:
            return SkipReason("no new landing commits since the last count")
        n, _ = count_available(tables, round_number(nxt), live["deployment_id"], need)
        if n < need:
            return SensorResult(
                skip_reason=f"{n}/{need} scored trajectories from {live['deployment_id']}", cursor=cursor
            )
    # production: the round snapshots the deployment counted, even if live moves before it runs
    config = {"ops": {"trajectories": {"config": {"deployment_id": live["deployment_id"]}}}}
    return SensorResult(
        run_requests=[
            RunRequest(
                run_key=nxt, partition_key=nxt, run_config=config if lab.source == "production" else {}
            )
        ],
        dynamic_partitions_requests=[AddDynamicPartitionsRequest(rounds.name, [nxt])],
        cursor=cursor,
    )


def _last_run_failed(context: SensorEvaluationContext, key: str) -> bool:
    runs = context.instance.get_runs(
        RunsFilter(job_name=round_job.name, tags={"dagster/partition": key}), limit=1
    )
    return bool(runs) and runs[0].status in (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
