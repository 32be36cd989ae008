"""The round sensor: start the next round when the schedule allows it (in production, once the
previous round's canary is decided) and, in production, enough scored traffic of the live
deployment has landed; run a round again whose run died."""

from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    DagsterRun,
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

from assets.dead_runs import DIED_TAG
from assets.jobs import round_job
from assets.partitions import round_key, round_number, rounds
from prodrl_pipeline.records import canaries
from prodrl_pipeline.records.registry import live_deployment, round_id
from prodrl_pipeline.records.snapshot import LANDING, count_available
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rounds import DEPLOYED, TRAFFIC_TAKEN, runs_again, start_blocker
from resources.lab import LabResource
from resources.store import StoreResource

ENDED_BADLY = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


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
    round k-1 is deployed; in production "deployed" means its canary is decided too) and, in
    production, once S*B scored trajectories served by the live deployment and not taken by a
    round have landed. The cursor is the landing tables' versions
    and live deployment counted (nothing new skips the query); the run key is the partition, so a
    re-evaluated tick never launches twice. Before that, a round whose newest run died
    (`dead_run_sensor` marked it) is run again with that run's config (`rounds.runs_again`; run key
    `<partition>-after-<run id>`: once per death)."""
    keys = sorted(context.instance.get_dynamic_partitions(rounds.name), key=round_number)
    latest = round_number(keys[-1]) if keys else 0
    done: dict[int, set[str]] = {}
    for asset in (TRAFFIC_TAKEN, DEPLOYED):
        for key in context.instance.get_materialized_partitions(AssetKey(asset)):
            done.setdefault(round_number(key), set()).add(asset)
    last = {k: _last_run(context, round_key(k)) for k in (latest - 1, latest) if k > 0}
    ended = {k: r for k, r in last.items() if r and r.status in ENDED_BADLY}
    died = {k: r for k, r in ended.items() if DIED_TAG in r.tags}
    if again := runs_again({k: _deaths(context, round_key(k)) for k in died}, done):
        return SensorResult(
            run_requests=[
                RunRequest(
                    run_key=f"{round_key(k)}-after-{died[k].run_id}",
                    partition_key=round_key(k),
                    run_config=died[k].run_config,
                )
                for k in again
            ]
        )
    tables = store.tables()
    if blocker := start_blocker(lab.schedule, latest, done, list(ended), _undecided(tables, lab.experiment)):
        return SkipReason(blocker)
    live = live_deployment(tables)
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


def _undecided(tables: DeltaStore, experiment: str) -> set[int]:
    """The rounds of `experiment` whose newest canary is open."""
    rows = canaries.canaries(tables) if tables.exists("canaries") else []
    newest = {r["deployment_id"]: r for r in rows}  # oldest first: the newest of each candidate wins
    return {
        r["round"]
        for r in newest.values()
        if r["status"] in canaries.UNDECIDED and r["deployment_id"] == round_id(experiment, r["round"])
    }


def _last_run(context: SensorEvaluationContext, key: str) -> DagsterRun | None:
    runs = context.instance.get_runs(_round_runs(key), limit=1)
    return runs[0] if runs else None


def _deaths(context: SensorEvaluationContext, key: str) -> int:
    return sum(DIED_TAG in r.tags for r in context.instance.get_runs(_round_runs(key)))


def _round_runs(key: str) -> RunsFilter:
    return RunsFilter(job_name=round_job.name, tags={"dagster/partition": key})
