"""The round sensor: start the next round when enough scored traffic of the live deployment exists."""

from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.jobs import round_job
from assets.partitions import round_key, round_number, rounds
from prodrl_pipeline.records.snapshot import LANDING, count_available
from resources.lab import LabResource
from resources.store import StoreResource


@sensor(job=round_job, minimum_interval_seconds=30, default_status=DefaultSensorStatus.STOPPED)
def round_sensor(context: SensorEvaluationContext, store: StoreResource, lab: LabResource):
    """Adds partition r(k+1) and requests its run in one result, once round k has finished (its
    `deployment` materialized) and, in production, once S*B scored trajectories served by the live
    deployment have landed. The cursor is the landing tables' versions counted (an unchanged landing
    skips the query); the run key is the partition, so a re-evaluated tick never launches twice."""
    keys = sorted(context.instance.get_dynamic_partitions(rounds.name), key=round_number)
    done = context.instance.get_materialized_partitions(AssetKey("deployment"))
    if keys and keys[-1] not in done:
        return SkipReason(f"round {keys[-1]} is still in flight")
    tables = store.tables()
    live = tables.live_deployment()
    if live is None:
        return SkipReason("no live deployment: materialize base_model first")
    nxt = round_key(round_number(keys[-1]) + 1 if keys else 1)
    cursor = None
    if lab.source == "production":
        need = lab.steps * lab.batch_size
        versions = {t: tables.table(t).version() for t in LANDING if tables.exists(t)}
        cursor = f"{nxt}|" + ",".join(f"{t}={v}" for t, v in sorted(versions.items()))
        if cursor == context.cursor:
            return SkipReason("no new landing commits since the last count")
        n, _ = count_available(tables, round_number(nxt), live["deployment_id"], need)
        if n < need:
            return SensorResult(
                skip_reason=f"{n}/{need} scored trajectories from {live['deployment_id']}", cursor=cursor
            )
    return SensorResult(
        run_requests=[RunRequest(run_key=nxt, partition_key=nxt)],
        dynamic_partitions_requests=[AddDynamicPartitionsRequest(rounds.name, [nxt])],
        cursor=cursor,
    )
