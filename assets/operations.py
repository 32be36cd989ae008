"""Scheduled operations outside the round graph: Delta maintenance and the live deployment's eval."""

from dagster import DefaultScheduleStatus, OpExecutionContext, ScheduleDefinition, job, op

from assets.evaluation import evaluate_deployment
from prodrl_pipeline.evals.gate import NO_EVALUATION
from prodrl_pipeline.evals.heldout import solve_rate
from prodrl_pipeline.records.schema import TABLES
from resources.lab import LabResource
from resources.store import StoreResource

RETENTION_HOURS = 7 * 24  # >= the replay window: a replay reads pinned versions up to a week old


@op
def maintain_tables(context: OpExecutionContext, store: StoreResource) -> None:
    tables = store.tables(context.run.run_id)
    for name in TABLES:
        if tables.exists(name):
            context.log.info(f"{name}: {tables.maintain(name, RETENTION_HOURS)}")


@op
def evaluate_live(context: OpExecutionContext, store: StoreResource, lab: LabResource) -> None:
    if not lab.evaluated():
        context.log.info(f"live deployment not evaluated: {NO_EVALUATION}")
        return
    tables = store.tables(context.run.run_id)
    live = tables.live_deployment()
    if live is None:
        context.log.warning("no live deployment to evaluate")
        return
    rows = evaluate_deployment(tables, lab, store.artifacts(), live, live["round"])
    context.log.info(f"live deployment {live['deployment_id']}: held-out solve rate {solve_rate(rows):.3f}")


@job(description="Compact, vacuum (retention >= the replay window) and checkpoint every Delta table")
def maintenance_job() -> None:
    maintain_tables()


@job(description="Re-evaluate the live deployment on the held-out puzzles (the lab; production has none yet)")
def eval_live_job() -> None:
    evaluate_live()


maintenance_schedule = ScheduleDefinition(
    job=maintenance_job, cron_schedule="0 3 * * *", default_status=DefaultScheduleStatus.STOPPED
)
eval_live_schedule = ScheduleDefinition(
    job=eval_live_job, cron_schedule="0 * * * *", default_status=DefaultScheduleStatus.STOPPED
)
