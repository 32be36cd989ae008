"""Round k's advantages, by `sql/advantages.sql` over the stored trajectories."""

import math

from dagster import AssetExecutionContext, BackfillPolicy, MaterializeResult, asset

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
    """Batch-mean baseline per minibatch of B trajectories; one row per trained trajectory."""
    return each_round(context, store, lambda key: _advantages_round(context, key, store, lab))


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
    tables.overwrite_round("advantages", rows, k)
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
        }
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)  # NaN in, NaN out: the advantage_sanity check reports it
