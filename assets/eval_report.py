"""Held-out evaluation of the round's deployment, and the run's curves so far."""

from dagster import AssetExecutionContext, BackfillPolicy, MaterializeResult, MetadataValue, asset

from assets import metadata
from assets.deployment import deployment
from assets.evaluation import evaluate_deployment
from assets.partitions import each_round, round_number, rounds
from prodrl_pipeline.evals.heldout import solve_rate, solve_rates_by_theme
from prodrl_pipeline.records.lineage import QUERY_TABLES, round_query
from prodrl_pipeline.records.queries import round_summary, stored_results
from prodrl_pipeline.records.registry import lookup, round_id
from resources.lab import LabResource
from resources.store import StoreResource

SUMMARY_COLUMNS = [
    "round",
    "train_reward",
    "heldout_solve_rate",
    "mate_in_1",
    "mate_in_2",
    "engine_mismatch",
    "staleness",
    "last_step",
]
RUN_LEVEL = frozenset({"curves", "rounds", "vs_original", "reward_curve", "mismatch_sawtooth"})
"""What describes the whole run up to the report's round: kept at the top of a ranged run's result."""
PLOTTED = ["train_reward", "engine_mismatch", "staleness", "kl", "clip_fraction"]
"""The round's numbers besides its solve rate, recorded as floats: the asset's Plots tab draws each
across the round partitions."""


@asset(
    partitions_def=rounds,
    deps=[deployment],
    group_name="round",
    kinds={"delta"},
    backfill_policy=BackfillPolicy.single_run(),
)
def eval_report(context: AssetExecutionContext, store: StoreResource, lab: LabResource) -> MaterializeResult:
    """The round's held-out results (stored per puzzle by the deploy gate's evaluation) and its
    training numbers (floats, plotted across rounds by the UI), the run's curves so far (in place,
    and as full plots), the per-round table, and the way back to the round's rows: its checkpoint
    and deployment locations, and a query that opens its calls, trajectories and steps."""
    one = lambda key: _eval_report_round(context, key, store, lab)  # noqa: E731
    return each_round(context, store, lab.experiment, one, RUN_LEVEL)


def _eval_report_round(
    context: AssetExecutionContext, key: str, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    k = round_number(key)
    tables = store.tables(context.run.run_id, key)
    dep = lookup(tables, "deployments", "deployment_id", round_id(lab.experiment, k))
    results = stored_results(tables, dep["deployment_id"]) or evaluate_deployment(
        tables, lab, store.artifacts(), dep, k
    )
    pinned = {t: tables.table(t).version() for t in QUERY_TABLES}  # the query reads what the report read
    summary = round_summary(tables, lab.experiment)
    this = next((r for r in summary if r["round"] == k), {})  # none without its held-out rows
    comparison = {}
    if lab.counterfactual:  # side by side with the original run on the same recorded traffic
        original = {r["round"]: r for r in round_summary(tables, lab.compare_to)}
        rows = [
            {
                "round": r["round"],
                f"{lab.compare_to} solve rate": original.get(r["round"], {}).get("heldout_solve_rate"),
                f"{lab.experiment} solve rate": r["heldout_solve_rate"],
                f"{lab.compare_to} mismatch": original.get(r["round"], {}).get("engine_mismatch"),
                f"{lab.experiment} mismatch": r["engine_mismatch"],
            }
            for r in summary
        ]
        comparison = {"vs_original": metadata.table(rows, list(rows[0]) if rows else [])}
    steps = sorted(
        (r for r in tables.read("train_steps").to_pylist() if r["experiment"] == lab.experiment),
        key=lambda r: r["step"],
    )
    rate = solve_rate(results)
    per_round = (
        [s["round"] for s in summary],
        {
            "held-out solve rate": [s["heldout_solve_rate"] for s in summary],
            "train reward": [_float(s["train_reward"]) for s in summary],
        },
    )
    context.log.info(f"round {k}: held-out solve rate {rate:.3f} over {len(results)} puzzles")
    return MaterializeResult(
        metadata={
            "curves": metadata.sparkline(*per_round, "per round"),
            "heldout_solve_rate": rate,
            "heldout_puzzles": len(results),
            **{f"solve_rate_{theme}": rate for theme, rate in solve_rates_by_theme(results).items()},
            **{name: _float(this.get(name)) for name in PLOTTED},
            "deployment_id": dep["deployment_id"],
            "deployment": metadata.location(dep["path"]),
            "checkpoint": metadata.location(
                lookup(tables, "checkpoints", "checkpoint_id", dep["checkpoint_id"])["path"]
            ),
            "query": MetadataValue.md(f"```python\n{round_query(tables, k, lab.experiment, pinned)}```"),
            **metadata.lineage(tables),
            "rounds": metadata.table(summary, SUMMARY_COLUMNS),
            **comparison,
            "reward_curve": metadata.plot(*per_round, "round", "reward per round"),
            "mismatch_sawtooth": metadata.plot(
                [r["step"] for r in steps],
                {
                    "|log pi - log pi_k| (staleness)": [r["staleness"] for r in steps],
                    "|log pi_k - log mu| (engine)": [r["engine_mismatch"] for r in steps],
                },
                "optimizer step",
                "mismatch over the run (staleness resets each round)",
            ),
        }
    )


def _float(value: float | None) -> float:
    """A round's number as a float for the Plots tab (NaN where the round has none)."""
    return float("nan") if value is None else float(value)
