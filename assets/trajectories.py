"""Round k's traffic: S*B scored trajectories of one deployment (`prodrl_pipeline.rounds` names it).

Lab source: play puzzles against that deployment. Production source: snapshot the gateway's
landing tables (traffic of the deployment the sensor counted, else of the live one), pinning their
Delta versions in this partition's metadata.
"""

import random
from collections import Counter

from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetRecordsFilter,
    BackfillPolicy,
    Config,
    Failure,
    MaterializeResult,
    asset,
)

from assets import metadata
from assets.base_model import base_model
from assets.partitions import each_round, round_number, rounds
from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.records.registry import live_deployment
from prodrl_pipeline.records.snapshot import snapshot_production
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.records.validate import prefix_continuity, split_valid
from prodrl_pipeline.rounds import traffic_deployment
from resources.lab import LabResource
from resources.store import StoreResource


class TrajectoriesConfig(Config):
    deployment_id: str | None = None
    """Production: snapshot this deployment's traffic (the sensor sets the one it counted S*B
    trajectories of); default: the live one."""
    recollect: bool = False
    """Collect again even if the round's trajectories are stored (they are immutable otherwise).
    A production round is re-read at the landing versions its first snapshot pinned."""


@asset(
    partitions_def=rounds,
    deps=[base_model],
    group_name="round",
    kinds={"delta"},
    backfill_policy=BackfillPolicy.single_run(),
)
def trajectories(
    context: AssetExecutionContext, config: TrajectoriesConfig, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    """Collect the round's trajectories, validate them against the data contract (violations go
    to `rejects`) and store calls and trajectories for the round."""
    return each_round(
        context, store, lab.experiment, lambda key: _trajectories_round(context, key, config, store, lab)
    )


def _trajectories_round(
    context: AssetExecutionContext,
    key: str,
    config: TrajectoriesConfig,
    store: StoreResource,
    lab: LabResource,
) -> MaterializeResult:
    k = round_number(key)
    tables = store.tables(context.run.run_id, key)
    stored = tables.read("trajectories", k)
    if stored.num_rows and not config.recollect:
        context.log.info(f"round {k}: {stored.num_rows} stored trajectories are kept (recollect=False)")
        return MaterializeResult(
            metadata={**_summary(stored.to_pylist(), tables, reused=True), **metadata.lineage(tables)}
        )
    registered = {d["deployment_id"]: d for d in tables.read("deployments").to_pylist()}
    try:
        source = traffic_deployment(
            source=lab.source,
            schedule=lab.schedule,
            counterfactual=lab.counterfactual,
            experiment=lab.experiment,
            round_=k,
            live=live_deployment(tables),
            registered=registered,
            counted=config.deployment_id,
        )
    except ValueError as e:
        raise Failure(description=str(e)) from e
    n = lab.steps * lab.batch_size
    pinned: dict[str, int | str] = {}
    if lab.source == "production":
        previous = _pinned_snapshot(context, key) if config.recollect else None
        deployment_id = previous["deployment_id"] if previous else source["deployment_id"]
        snap = snapshot_production(tables, k, deployment_id, n, previous and previous["versions"])
        if len(snap.trajectories) < n:
            raise Failure(
                description=f"round {k}: {len(snap.trajectories)} scored trajectories from "
                f"{deployment_id} are available, the round needs S*B = {n}"
            )
        calls, trajs = snap.calls, snap.trajectories
        pinned = {
            **{f"{t}_version": v for t, v in snap.versions.items()},
            "snapshot_deployment": deployment_id,
        }
    else:
        calls, trajs = _collect_lab(context, lab, store.artifacts(), source, k, n)
    calls, trajs, rejects = split_valid(calls, trajs)
    extending, later = prefix_continuity(calls)
    tables.overwrite_round("calls", calls, k)
    tables.overwrite("rejects", rejects, f"round = {k} AND table_name IN ('calls', 'trajectories')")
    tables.overwrite_round("trajectories", trajs, k)  # last: stored trajectories mark the round collected
    return MaterializeResult(
        metadata={
            **_summary(trajs, tables, reused=False, n_calls=len(calls), n_rejects=len(rejects)),
            "source": lab.source,
            # multi-turn calls whose prompt extends the previous call's prompt + completion exactly
            "prefix_continuity": extending / later if later else float("nan"),
            "prefix_breaks": later - extending,
            **pinned,
            **metadata.lineage(tables),
        }
    )


def _collect_lab(  # noqa: PLR0913
    context: AssetExecutionContext, lab: LabResource, artifacts: Artifacts, live: dict, k: int, n: int
):
    pool = lab.puzzles("train")
    rng = random.Random(lab.seed * 1_000_003 + k)
    puzzles = rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)
    context.log.info(f"round {k}: collecting {n} trajectories from deployment {live['deployment_id']}")
    rollouts = play(
        lab.engine(artifacts.local(live["path"]), live["quant_format"]),
        lab.tokenizer(),
        puzzles,
        lab.sampling(),
        deployment_id=live["deployment_id"],
        round_=k,
        seed=lab.seed * 1_000_003 + k,
        mode=lab.mode,
        constrain=lab.constrain_moves,
        partial_credit=lab.partial_credit,
        progress=lambda done, total: context.log.info(f"round {k}: {done}/{total} trajectories"),
    )
    return rollouts.calls, rollouts.trajectories


def _pinned_snapshot(context: AssetExecutionContext, key: str) -> dict | None:
    """The deployment and landing versions this partition's last production snapshot read."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey("trajectories"), asset_partitions=[key]),
        limit=1,
    ).records
    meta = records[0].asset_materialization.metadata if records else {}
    keys = ("landing_calls_version", "landing_feedback_version", "snapshot_deployment")
    if not all(k in meta for k in keys):
        return None
    versions = {t: meta[f"{t}_version"].value for t in ("landing_calls", "landing_feedback")}
    return {"deployment_id": meta["snapshot_deployment"].value, "versions": versions}


def _summary(trajs: list[dict], tables: DeltaStore, reused: bool, **extra: int) -> dict:
    rewards = [t["reward"] for t in trajs]
    return {
        "trajectories": len(trajs),
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "deployments": ", ".join(f"{d} ({n})" for d, n in Counter(t["deployment_id"] for t in trajs).items()),
        "completion_tokens": sum(t["n_completion_tokens"] for t in trajs),
        "reused_stored": reused,
        "trajectories_version": tables.table("trajectories").version(),
        "calls_version": tables.table("calls").version(),
        **extra,
    }
