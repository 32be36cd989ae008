"""The production gate's decision (docs/operations.md, "The production gate"): `canary_sensor`
launches `canary_job` once the open canary's rule can decide (both arms at `min_per_arm`, or past
`max_wait_hours`); an operator launches the same job from the Launchpad to override it. The job
promotes or rolls back (`records.canaries.settle`) and reports the decision as the round's
`deploy_gate` check on `deployment`, with what it measured."""

from datetime import UTC, datetime
from typing import Literal

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetKey,
    Config,
    DagsterRunStatus,
    DefaultSensorStatus,
    Failure,
    MetadataValue,
    OpExecutionContext,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    job,
    op,
    sensor,
)

from assets.launch import IN_FLIGHT
from assets.partitions import round_key
from prodrl_pipeline.evals.canary import Verdict
from prodrl_pipeline.records import canaries
from prodrl_pipeline.records.registry import live_deployment, round_id
from resources.lab import LabResource
from resources.store import StoreResource

CANARY_TAG = "prodrl/canary"
"""The canary a `canary_job` run decides (on the runs the sensor requests)."""
MAX_RUNTIME_SECONDS = 900
"""A `canary_job` run still going after this is failed by run monitoring (instance.yaml), so that a
run that died without its status changing (its machine lost) cannot hold a promotion forever."""
DECISION_TAG = "prodrl/decision"
"""On every `canary_job` run: instance.yaml runs one at a time (the claim is safe regardless)."""


class CanaryDecisionConfig(Config):
    round: int
    """The round whose canary is decided (the newest canary of its candidate)."""
    decision: Literal["rule", "promote", "roll_back"] = "rule"
    """rule: the gate's test decides (what the sensor launches; nothing happens while it says
    wait). promote / roll_back: an operator overrides it, whatever the test says."""
    operator: str = ""
    """Who overrides (required with promote and roll_back; recorded as `decided_by`)."""
    reason: str = ""
    """Why (required with promote and roll_back; recorded with the decision)."""


@op
def decide_canary(
    context: OpExecutionContext, config: CanaryDecisionConfig, store: StoreResource, lab: LabResource
):
    """Decide round `round`'s open canary: by the rule, or as the operator says (the rule's
    numbers are recorded either way). Promoting moves live to the candidate; rolling back leaves
    live, and every call either arm served stays in the landing tables."""
    by_hand = config.decision != "rule"
    if by_hand and not (config.operator.strip() and config.reason.strip()):
        raise Failure(description="an override (promote or roll_back) names its operator and its reason")
    tables = store.tables(context.run.run_id, round_key(config.round))
    rows = canaries.sync(tables) if tables.exists("canaries") else []
    row = canaries.of_round(rows, round_id(lab.experiment, config.round))
    if row is None:
        raise Failure(description=f"round {config.round} of {lab.experiment} has no canary")
    if (requested := context.run.tags.get(CANARY_TAG)) and requested != row["canary_id"]:
        context.log.warning(
            f"requested for canary {requested}; round {config.round}'s is now {row['canary_id']}"
        )
        return
    if row["status"] not in canaries.UNDECIDED:
        if requested and not by_hand:  # the sensor's run, for a canary decided (or finished) meanwhile
            context.log.warning(f"canary {row['canary_id']} was decided already: {row['status']}")
            return
        raise Failure(
            description=f"canary {row['canary_id']} was decided already: {row['status']} by "
            f"{row['decided_by']} ({row['reason']})"
        )
    if row["status"] == canaries.PROMOTING and by_hand:
        raise Failure(
            description=f"canary {row['canary_id']} is being promoted ({row['reason']}) since "
            f"{row['decided_at']:%Y-%m-%d %H:%M:%S} UTC: decided already; canary_job with decision rule "
            "finishes the promotion"
        )
    verdict, versions = canaries.evaluate(tables, rows, row, datetime.now(UTC))
    try:
        if row["status"] == canaries.PROMOTING:  # claimed by a run that died before it finished
            context.log.info(f"canary {row['canary_id']}: finishing the promotion {row['reason']!r}")
            closed = canaries.finish(tables, row)
        else:
            if not by_hand and verdict.decision == "wait":
                context.log.info(f"canary {row['canary_id']}: {verdict.reason}; nothing decided")
                return
            promote = config.decision == "promote" or (not by_hand and verdict.decision == "promote")
            decided_by, reason = canaries.BY_RULE, verdict.reason
            if by_hand:
                decided_by = config.operator.strip()
                reason = (
                    f"{config.decision} by {decided_by}: {config.reason.strip()} (the rule: {verdict.reason})"
                )
            closed = canaries.settle(tables, row, promote, decided_by, reason, verdict.numbers())
    except canaries.AlreadyDecided as e:  # a concurrent run's decision applied, not this one
        if by_hand:
            raise Failure(description=f"{e}; this override was not applied") from e
        context.log.warning(f"{e}; this run's decision was not applied")
        return
    live = live_deployment(tables)["deployment_id"]
    context.log.info(f"canary {row['canary_id']}: {closed['reason']}; live is {live}")
    context.log_event(
        AssetCheckEvaluation(
            asset_key=AssetKey("deployment"),
            check_name="deploy_gate",
            passed=closed["status"] == canaries.PROMOTED,
            severity=AssetCheckSeverity.ERROR,
            description=closed["reason"],
            metadata=_metadata(closed, verdict, live) | {"landing_versions": MetadataValue.json(versions)},
            partition=round_key(config.round),
        )
    )


def _metadata(row: dict, verdict: Verdict, live: str) -> dict:
    config = canaries.config_of(row)
    return {
        "gate": "canary",
        "canary_id": row["canary_id"],
        "candidate": row["deployment_id"],
        "control": row["control_id"],
        "status": row["status"],
        "decided_by": row["decided_by"],
        **verdict.numbers(),
        **(
            {"interval": MetadataValue.json(list(verdict.difference.interval(config.confidence)))}
            if verdict.difference
            else {}
        ),
        "share": config.share,
        "margin": config.margin,
        "confidence": config.confidence,
        "min_per_arm": config.min_per_arm,
        "max_wait_hours": config.max_wait_hours,
        "live_now": live,
    }


@job(
    tags={DECISION_TAG: "canary", "dagster/max_runtime": str(MAX_RUNTIME_SECONDS)},
    description="Decide a round's production canary: by the gate's rule (the sensor launches it), or "
    "promote / roll_back by hand (config: round, decision, operator, reason)",
)
def canary_job() -> None:
    decide_canary()


def canary_sensor(minimum_interval_seconds: int = 30) -> SensorDefinition:
    """The canary sensor, evaluated by the daemon at most every `minimum_interval_seconds`."""
    return sensor(
        name="canary_sensor",
        job=canary_job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.STOPPED,
    )(due_canary)


def due_canary(context: SensorEvaluationContext, store: StoreResource, lab: LabResource):
    """Requests `canary_job` for the active canary once its rule can decide (run key: the canary and
    its control, so it is requested once per control, and again after a run of it failed or was
    cancelled), or to finish a promotion while no canary_job run is in flight (its run died); says
    why it waits otherwise."""
    tables = store.tables()
    rows = canaries.sync(tables) if tables.exists("canaries") else []  # judged against live now
    found = canaries.active(rows)
    if found is None:
        return SkipReason("no open canary")
    row = found[0]
    failed = len(
        context.instance.get_runs(
            RunsFilter(
                job_name=canary_job.name,
                tags={CANARY_TAG: row["canary_id"]},
                statuses=[DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED],
            )
        )
    )
    again = f":{failed}" if failed else ""  # after a failed or cancelled run (a retry too): anew
    if row["status"] == canaries.PROMOTING:  # its deciding run died mid-promotion: finish it
        # any canary_job run in flight (the sensor's or the Launchpad's) may be the one finishing it
        if running := context.instance.get_runs(
            RunsFilter(job_name=canary_job.name, statuses=IN_FLIGHT), limit=1
        ):
            return SkipReason(
                f"canary {row['canary_id']} is being promoted; canary_job run {running[0].run_id} is in "
                "flight"
            )
        return RunRequest(
            run_key=f"{row['canary_id']}:finish{again}",
            run_config={"ops": {"decide_canary": {"config": {"round": row["round"]}}}},
            tags={CANARY_TAG: row["canary_id"]},
        )
    verdict, _ = canaries.evaluate(tables, rows, row, datetime.now(UTC))
    if verdict.decision == "wait":
        wait = canaries.config_of(row).max_wait_hours
        return SkipReason(
            f"canary {row['canary_id']}: {verdict.reason} ({verdict.waited_hours:.2f} of {wait:g} h)"
        )
    return RunRequest(  # a run that found the control moved decided nothing: the new control, a new key
        run_key=f"{row['canary_id']}@{row['control_id']}{again}",
        run_config={"ops": {"decide_canary": {"config": {"round": row["round"]}}}},
        tags={CANARY_TAG: row["canary_id"]},
    )
