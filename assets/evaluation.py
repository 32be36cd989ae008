"""Held-out evaluation of a registered deployment, stored in `eval_results` (shared by assets)."""

from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.evals.heldout import evaluate
from prodrl_pipeline.records.store import DeltaStore
from resources.lab import LabResource


def evaluate_deployment(
    tables: DeltaStore, lab: LabResource, artifacts: Artifacts, deployment: dict, round_: int
) -> list[dict]:
    """Greedy solve of round `round_`'s held-out puzzles (`LabResource.heldout`) by `deployment`;
    replaces its rows for `round_`."""
    heldout = lab.heldout(round_)
    rows = evaluate(
        lab.engine(artifacts.local(deployment["path"]), deployment["quant_format"]),
        lab.tokenizer(),
        heldout,
        deployment_id=deployment["deployment_id"],
        round_=round_,
        seed=lab.seed,
        mode=lab.mode,
        constrain=lab.mode == "structured" or lab.constrain_moves,  # structured: always, as before
        max_tokens=lab.max_tokens,
    )
    tables.overwrite(
        "eval_results", rows, f"round = {round_} AND deployment_id = '{deployment['deployment_id']}'"
    )
    return rows
