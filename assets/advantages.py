"""Round k's advantages, by `sql/advantages.sql` over the stored trajectories."""

import math

from dagster import AssetExecutionContext, BackfillPolicy, Failure, MaterializeResult, asset

from assets import metadata
from assets.partitions import each_round, round_number, rounds
from assets.trajectories import trajectories
from prodrl_pipeline.records.queries import compute_advantages
from resources.lab import LabResource
from resources.store import StoreResource


@asset(
    partitions_def=rounds,
    deps=[trajectories],
    group_name="round",
    kinds={"delta", "sql"},
    backfill_policy=BackfillPolicy.single_run(),
)
def advantages(context: AssetExecutionContext, store: StoreResource, lab: LabResource) -> MaterializeResult:
    """Batch-mean baseline per minibatch of B trajectories; one row per trained trajectory. The
    table is per round: a counterfactual replay keeps the stored advantages of the experiment that
    collected the traffic, and fails if its own settings would give other ones."""
    return each_round(context, store, lab.experiment, lambda key: _advantages_round(context, key, store, lab))


def _advantages_round(
    context: AssetExecutionContext, key: str, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    k = round_number(key)
    tables = store.tables(context.run.run_id, key)
    cfg = lab.trainer()
    version = tables.table("trajectories").version()
    rows = compute_advantages(tables, k, cfg.batch_size, cfg.steps, cfg.seed)
    if rows.num_rows == 0:
        raise RuntimeError(f"round {k}: no scored trajectories to compute advantages from")
    stored = tables.read("advantages", k).sort_by("trajectory_id")
    if not lab.counterfactual or not stored.num_rows:
        tables.overwrite_round("advantages", rows, k)
    elif not stored.equals(rows.select(stored.schema.names).cast(stored.schema).sort_by("trajectory_id")):
        raise Failure(
            description=f"round {k}: this counterfactual replay's trainer settings (steps, batch_size, "
            "seed) give other advantages than those stored for the round, which the experiment that "
            "collected its traffic trains on; replay it with that experiment's settings"
        )
    adv = rows.column("advantage").to_pylist()
    minibatches = len(set(rows.column("minibatch").to_pylist()))
    if minibatches < cfg.steps:
        context.log.warning(
            f"round {k}: only {minibatches} full or partial minibatches for S={cfg.steps} steps"
        )
    return MaterializeResult(
        metadata={
            "trajectories": rows.num_rows,
            "minibatches": minibatches,
            "reward_mean": _mean(rows.column("reward").to_pylist()),
            "advantage_std": math.sqrt(_mean([(a - _mean(adv)) ** 2 for a in adv])),
            "trajectories_version_read": version,
            **metadata.lineage(tables),
        }
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)  # NaN in, NaN out: the advantage_sanity check reports it
