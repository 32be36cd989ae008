"""Operations outside the round graph: Delta maintenance and the live deployment's eval (scheduled),
and the clean-up of artifacts no registry row names (launched by hand)."""

from datetime import UTC, datetime, timedelta

from dagster import (
    Config,
    DefaultScheduleStatus,
    MetadataValue,
    OpExecutionContext,
    ScheduleDefinition,
    job,
    op,
)

from assets.evaluation import evaluate_deployment
from prodrl_pipeline.cleanup import remove, unreferenced
from prodrl_pipeline.evals.gate import NO_EVALUATION
from prodrl_pipeline.evals.heldout import solve_rate
from prodrl_pipeline.evals.report import markdown_table
from prodrl_pipeline.records.registry import live_deployment
from prodrl_pipeline.records.schema import TABLES
from resources.lab import LabResource
from resources.store import StoreResource

RETENTION_HOURS = 7 * 24  # >= the replay window: a replay reads pinned versions up to a week old
REGISTRIES = ("checkpoints", "deployments")  # their rows' paths name the artifacts in use


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
    live = live_deployment(tables)
    if live is None:
        context.log.warning("no live deployment to evaluate")
        return
    rows = evaluate_deployment(tables, lab, store.artifacts(), live, live["round"])
    context.log.info(f"live deployment {live['deployment_id']}: held-out solve rate {solve_rate(rows):.3f}")


class CleanupConfig(Config):
    delete: bool = False
    """Delete what the run lists; without it the run only lists it (a dry run)."""
    min_age_hours: float = 24.0
    """Keep whatever was modified in the last this many hours: a run in flight may be writing a
    version it has not registered yet, or downloading one."""


@op
def unreferenced_artifacts(context: OpExecutionContext, config: CleanupConfig, store: StoreResource) -> None:
    """Lists, in its output's metadata, the checkpoint and deployment versions and the download-cache
    entries that no row of the checkpoints or deployments registry names (`prodrl_pipeline/cleanup.py`)
    and that are older than `min_age_hours` (`collected`), and those it keeps for their age
    (`recent`); with `delete: true` it deletes the collected ones."""
    tables, artifacts = store.tables(context.run.run_id), store.artifacts()
    named = [p for t in REGISTRIES if tables.exists(t) for p in tables.read(t).column("path").to_pylist()]
    cutoff = datetime.now(UTC) - timedelta(hours=config.min_age_hours)
    found = unreferenced(artifacts, named)
    collected = [u for u in found if u.modified < cutoff]
    if config.delete:
        remove(artifacts, collected)
    done = "deleted" if config.delete else "would delete"
    for u in collected:
        context.log.info(f"{done} {u.kind} {u.uri}: {u.files} files, {u.size:,} bytes")
    rows = [
        {
            "kind": u.kind,
            "where": u.uri,
            "files": u.files,
            "bytes": f"{u.size:,}",
            "modified (UTC)": f"{u.modified:%Y-%m-%d %H:%M}",
            "action": done if u in collected else f"kept: younger than {config.min_age_hours:g} h",
        }
        for u in found
    ]
    columns = ["kind", "where", "files", "bytes", "modified (UTC)", "action"]
    context.add_output_metadata(
        {
            "dry_run": MetadataValue.bool(not config.delete),
            "collected": MetadataValue.json([u.uri for u in collected]),
            "collected_bytes": MetadataValue.int(sum(u.size for u in collected)),
            "recent": MetadataValue.json([u.uri for u in found if u not in collected]),
            "unreferenced": MetadataValue.md(markdown_table(rows, columns)),
        }
    )


@job(description="Compact, vacuum (retention >= the replay window) and checkpoint every Delta table")
def maintenance_job() -> None:
    maintain_tables()


@job(description="Re-evaluate the live deployment on the held-out puzzles (the lab; production has none yet)")
def eval_live_job() -> None:
    evaluate_live()


@job(
    description="List the artifact versions and download-cache entries no registry row names "
    "(config delete: true deletes them)"
)
def cleanup_job() -> None:
    unreferenced_artifacts()


maintenance_schedule = ScheduleDefinition(
    job=maintenance_job, cron_schedule="0 3 * * *", default_status=DefaultScheduleStatus.STOPPED
)
eval_live_schedule = ScheduleDefinition(
    job=eval_live_job, cron_schedule="0 * * * *", default_status=DefaultScheduleStatus.STOPPED
)
