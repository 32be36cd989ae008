"""Held-out evaluation of the round's deployment, and the run's curves so far."""

from dagster import AssetExecutionContext, BackfillPolicy, MaterializeResult, asset

from assets import metadata
from assets.deployment import deployment
from assets.evaluation import evaluate_deployment
from assets.partitions import each_round, round_number, rounds
from prodrl_pipeline.evals.heldout import solve_rate, solve_rates_by_theme
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


@asset(
    partitions_def=rounds,
    deps=[deployment],
    group_name="round",
    kinds={"delta"},
    backfill_policy=BackfillPolicy.single_run(),
)
def eval_report(context: AssetExecutionContext, store: StoreResource, lab: LabResource) -> MaterializeResult:
    """The round's held-out results (stored per puzzle by the deploy gate's evaluation), the
    per-round table of the run, the reward curve and the mismatch sawtooth."""
    return each_round(
        context, store, lab.experiment, lambda key: _eval_report_round(context, key, store, lab)
    )


def _eval_report_round(
    context: AssetExecutionContext, key: str, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    k = round_number(key)
    tables = store.tables(context.run.run_id, key)
    dep = lookup(tables, "deployments", "deployment_id", round_id(lab.experiment, k))
    results = stored_results(tables, dep["deployment_id"]) or evaluate_deployment(
        tables, lab, store.artifacts(), dep, k
    )
    summary = round_summary(tables, lab.experiment)
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
    context.log.info(f"round {k}: held-out solve rate {rate:.3f} over {len(results)} puzzles")
    return MaterializeResult(
        metadata={
            "heldout_solve_rate": rate,
            "heldout_puzzles": len(results),
            **{f"solve_rate_{theme}": rate for theme, rate in solve_rates_by_theme(results).items()},
            "deployment_id": dep["deployment_id"],
            "rounds": metadata.table(summary, SUMMARY_COLUMNS),
            **comparison,
            "reward_curve": metadata.plot(
                [s["round"] for s in summary],
                {
                    "held-out solve rate": [s["heldout_solve_rate"] for s in summary],
                    "train reward": [
                        s["train_reward"] if s["train_reward"] is not None else float("nan") for s in summary
                    ],
                },
                "round",
                "reward per round",
            ),
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
