"""Held-out evaluation of the round's deployment (the lab; production has none yet), and the run's
curves so far."""

from dagster import AssetExecutionContext, BackfillPolicy, MaterializeResult, MetadataValue, asset

from assets import metadata
from assets.deployment import deployment
from assets.evaluation import evaluate_deployment
from assets.partitions import each_round, round_number, rounds
from prodrl_pipeline.evals.gate import NO_EVALUATION
from prodrl_pipeline.evals.heldout import solve_rate, solve_rates_by_theme
from prodrl_pipeline.records.lineage import QUERY_TABLES, round_query
from prodrl_pipeline.records.queries import round_summary, stored_results, training_summary
from prodrl_pipeline.records.registry import lookup, round_id
from prodrl_pipeline.records.store import DeltaStore
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
TRAINING_COLUMNS = [c for c in SUMMARY_COLUMNS if c not in ("heldout_solve_rate", "mate_in_1", "mate_in_2")]
"""The per-round table in production mode: no deployment is evaluated."""
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
    """The round's held-out results (the lab: stored per puzzle by the deploy gate's evaluation;
    production: none, and `evaluation` says so) and its training numbers (floats, plotted across
    rounds by the UI), the run's curves so far (in place, and as full plots), the per-round table,
    and the way back to the round's rows: its checkpoint and deployment locations, and a query that
    opens its calls, trajectories and steps."""
    one = lambda key: _eval_report_round(context, key, store, lab)  # noqa: E731
    return each_round(context, store, lab.experiment, one, RUN_LEVEL)


def _eval_report_round(
    context: AssetExecutionContext, key: str, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    k = round_number(key)
    tables = store.tables(context.run.run_id, key)
    dep = lookup(tables, "deployments", "deployment_id", round_id(lab.experiment, k))
    evaluation = _evaluation(context, tables, lab, store, dep)
    evaluated = lab.evaluated()
    pinned = {t: tables.table(t).version() for t in QUERY_TABLES}  # the query reads what the report read
    summarize = round_summary if evaluated else training_summary
    summary = summarize(tables, lab.experiment)
    this = next((r for r in summary if r["round"] == k), {})  # lab: none without its held-out rows
    compared = {"solve rate": "heldout_solve_rate"} if evaluated else {}
    compared["mismatch"] = "engine_mismatch"
    comparison = {}
    if lab.counterfactual:  # side by side with the original run on the same recorded traffic
        original = {r["round"]: r for r in summarize(tables, lab.compare_to)}
        rows = [
            {
                "round": r["round"],
                **{
                    f"{run} {name}": row.get(column)
                    for name, column in compared.items()
                    for run, row in ((lab.compare_to, original.get(r["round"], {})), (lab.experiment, r))
                },
            }
            for r in summary
        ]
        comparison = {"vs_original": metadata.table(rows, list(rows[0]) if rows else [])}
    steps = sorted(
        (r for r in tables.read("train_steps").to_pylist() if r["experiment"] == lab.experiment),
        key=lambda r: r["step"],
    )
    curves = {"held-out solve rate": [s["heldout_solve_rate"] for s in summary]} if evaluated else {}
    curves["train reward"] = [_float(s["train_reward"]) for s in summary]
    per_round = ([s["round"] for s in summary], curves)
    return MaterializeResult(
        metadata={
            "curves": metadata.sparkline(*per_round, "per round"),
            **evaluation,
            **{name: _float(this.get(name)) for name in PLOTTED},
            "deployment_id": dep["deployment_id"],
            "deployment": metadata.location(dep["path"]),
            "checkpoint": metadata.location(
                lookup(tables, "checkpoints", "checkpoint_id", dep["checkpoint_id"])["path"]
            ),
            "query": MetadataValue.md(f"```python\n{round_query(tables, k, lab.experiment, pinned)}```"),
            **metadata.lineage(tables),
            "rounds": metadata.table(summary, SUMMARY_COLUMNS if evaluated else TRAINING_COLUMNS),
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


def _evaluation(
    context: AssetExecutionContext, tables: DeltaStore, lab: LabResource, store: StoreResource, dep: dict
) -> dict:
    """The round's deployment's held-out solve rates (the lab: stored by the deploy gate, else
    evaluated now), or, in production, that there is no evaluation."""
    k = dep["round"]
    if not lab.evaluated():
        context.log.info(f"round {k}: evaluation {NO_EVALUATION}")
        return {"evaluation": NO_EVALUATION}
    results = stored_results(tables, dep["deployment_id"]) or evaluate_deployment(
        tables, lab, store.artifacts(), dep, k
    )
    rate = solve_rate(results)
    context.log.info(f"round {k}: held-out solve rate {rate:.3f} over {len(results)} puzzles")
    return {
        "heldout_solve_rate": rate,
        "heldout_puzzles": len(results),
        **{f"solve_rate_{theme}": rate for theme, rate in solve_rates_by_theme(results).items()},
    }


def _float(value: float | None) -> float:
    """A round's number as a float for the Plots tab (NaN where the round has none)."""
    return float("nan") if value is None else float(value)
