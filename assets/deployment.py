"""mu_{k+1}: the round's checkpoint exported (NVFP4), registered, gated, and made live (production:
its canary opened; `assets/canary.py` makes it live if the canary passes)."""

import json
from dataclasses import asdict

from dagster import (
    AssetCheckResult,
    AssetCheckSpec,
    AssetExecutionContext,
    BackfillPolicy,
    Failure,
    MaterializeResult,
    asset,
)

from assets import metadata
from assets.checkpoint import checkpoint
from assets.evaluation import evaluate_deployment
from assets.partitions import each_round, round_number, rounds
from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.engine.vllm_server import (
    golden_check,
    model_logprobs,
    served_logprobs,
    swap,
    weight_label,
)
from prodrl_pipeline.evals.gate import NO_EVALUATION, NO_GATE, deploy_gate
from prodrl_pipeline.evals.heldout import solve_rate
from prodrl_pipeline.quant.nvfp4 import export_deployment, load_deployment, weight_error
from prodrl_pipeline.records.canaries import CanaryBusy, open_canary, supersede
from prodrl_pipeline.records.queries import stored_results
from prodrl_pipeline.records.registry import live_deployment, lookup, move_live, register_deployment, round_id
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.checkpoint import load_checkpoint
from prodrl_pipeline.rounds import goes_live
from resources.lab import LabResource
from resources.store import StoreResource

CALIBRATION_CALLS = 16
GOLDEN_CALLS = 8  # recorded calls whose completions the vLLM swap check scores


@asset(
    partitions_def=rounds,
    deps=[checkpoint],
    group_name="round",
    kinds={"pytorch", "delta"},
    check_specs=[
        AssetCheckSpec(
            "deploy_gate",
            asset="deployment",
            blocking=True,
            description="lab: held-out solve rate not worse than live's beyond the margin; "
            "production: the candidate's canary on live traffic (passes when it opens; canary_job "
            "records its decision here)",
            partitions_def=rounds,
        )
    ],
    backfill_policy=BackfillPolicy.single_run(),
)
def deployment(context: AssetExecutionContext, store: StoreResource, lab: LabResource) -> MaterializeResult:
    """Quantize and register the round's checkpoint and make it live only if the deploy gate passes
    (the lab: it is evaluated on the held-out puzzles against live; otherwise live stays and
    downstream assets are skipped). Production opens the candidate's canary instead (live moves
    if `canary_job` promotes it), or with the canary off makes it live unevaluated."""
    return each_round(context, store, lab.experiment, lambda key: _deployment_round(context, key, store, lab))


def _swap_vllm(  # noqa: PLR0913
    context: AssetExecutionContext,
    lab: LabResource,
    artifacts: Artifacts,
    new: dict,
    live: dict,
    golden: list[tuple[list[int], list[int]]],
) -> None:
    """Serve the `new` deployment row on the vLLM server in place of `live`, tagged with its label,
    and check that the served log-probs of the golden continuations are the new export's; on
    failure `live` is served again and the step fails."""
    new_path, old_path = artifacts.local(new["path"]), artifacts.local(live["path"])
    expected = [model_logprobs(load_deployment(p), golden) for p in (new_path, old_path)]
    previous = (old_path, weight_label(live))
    swap(lab.vllm_url, new_path, weight_label(new), previous)
    try:
        passed, reason = golden_check(served_logprobs(lab.vllm_url, lab.vllm_model, golden), *expected)
    except Exception:
        swap(lab.vllm_url, *previous)  # not checked: live stays, and so must the served weights
        raise
    context.log.info(f"vLLM at {lab.vllm_url} serves {new['deployment_id']}: {reason}")
    if not passed:
        swap(lab.vllm_url, *previous)
        raise Failure(
            f"vLLM does not serve {new['deployment_id']}'s weights after the swap ({reason}); "
            f"it serves {live['deployment_id']} again"
        )


def _deployment_round(
    context: AssetExecutionContext, key: str, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    k = round_number(key)
    tables = store.tables(context.run.run_id, key)
    dep_id = round_id(lab.experiment, k)
    if lab.canary_gate() and not lab.counterfactual:
        try:  # its canary measured the earlier export: roll it back before this one is written
            supersede(tables, dep_id)
        except CanaryBusy as e:
            raise Failure(description=str(e)) from e
    ckpt = lookup(tables, "checkpoints", "checkpoint_id", dep_id)
    artifacts = store.artifacts()
    model, _, _ = load_checkpoint(artifacts.local(ckpt["path"]))
    calls = tables.read("calls", k).slice(0, CALIBRATION_CALLS)  # activation scales from real traffic
    calibration = [
        p + c
        for p, c in zip(
            calls["prompt_token_ids"].to_pylist(), calls["completion_token_ids"].to_pylist(), strict=True
        )
    ]
    with artifacts.writing(artifacts.uri("deployments", lab.experiment, key)) as upload:
        export_deployment(model, upload.folder, lab.quant_format, calibration)
        export_bytes = sum(f.stat().st_size for f in upload.folder.iterdir())
        rel_error = weight_error(model, upload.folder)
    path = upload.uri
    live = live_deployment(tables)  # before registering: a re-run may re-register the live one
    register_deployment(
        tables,
        deployment_id=dep_id,
        round_=k,
        checkpoint_id=ckpt["checkpoint_id"],
        path=path,
        quant_format=lab.quant_format,
        sampling_json=json.dumps(asdict(lab.sampling())),
    )
    new = lookup(tables, "deployments", "deployment_id", dep_id)
    passed, reason, evaluation, gate_metadata = _gate(tables, lab, artifacts, new, live)
    decide = lambda now: goes_live(  # noqa: E731
        gate_passed=passed,
        counterfactual=lab.counterfactual,
        round_=k,
        candidate=dep_id,
        gated_against=live["deployment_id"],
        live=now,
    )
    canary = lab.canary_gate()
    if canary and decide(live) and live["deployment_id"] != dep_id:  # it goes live through its canary
        row = open_canary(
            tables, deployment_id=dep_id, round_=k, control_id=live["deployment_id"], config=canary
        )
        reason = (
            f"canary {row['canary_id']} open: {dep_id} serves {canary.share:.0%} of new trajectories beside "
            f"{row['control_id']}; canary_job decides once each arm has {canary.min_per_arm} scored "
            f"trajectories, or rolls back after {canary.max_wait_hours:g} h"
            if row["status"] == "open"
            else f"canary {row['canary_id']} {row['status']} as it opened: {row['reason']}"
        )
        gate_metadata |= {k: row[k] for k in ("canary_id", "status")} | {"control": row["control_id"]}
        decide = lambda now: False  # noqa: E731 - live moves when the canary is promoted
    elif canary:
        reason = (
            f"no canary: {dep_id} is live already (exported again)"
            if live["deployment_id"] == dep_id
            else f"no canary: {dep_id} would not go live (a replay, or live is from a later round)"
        )
    serving = lab.vllm_url and decide(live)
    if serving:  # the engine serves the new weights before the pointer names them
        golden = list(
            zip(calls["prompt_token_ids"].to_pylist(), calls["completion_token_ids"].to_pylist(), strict=True)
        )
        _swap_vllm(context, lab, artifacts, new, live, golden[:GOLDEN_CALLS])
    moved = move_live(tables, dep_id, decide)  # decided on the live row read in the same commit
    if serving and not moved:  # live moved under this run: the engine serves what is live now
        now = live_deployment(tables)
        swap(lab.vllm_url, artifacts.local(now["path"]), weight_label(now))
    context.log.info(f"round {k}: {reason}; live is {live_deployment(tables)['deployment_id']}")
    return MaterializeResult(
        metadata={
            "deployment_id": dep_id,
            "checkpoint_id": ckpt["checkpoint_id"],
            "path": metadata.location(path),
            "quant_format": lab.quant_format,
            "previous_live": live["deployment_id"],
            "moved_live": moved,
            "live_now": live_deployment(tables)["deployment_id"],
            **evaluation,
            "export_bytes": export_bytes,
            "weight_rel_error": rel_error,
            **metadata.lineage(tables),
        },
        check_results=[
            AssetCheckResult(
                check_name="deploy_gate",
                passed=passed,
                description=reason,
                metadata={**gate_metadata, "live_deployment": live["deployment_id"]},
            )
        ],
    )


def _gate(
    tables: DeltaStore, lab: LabResource, artifacts: Artifacts, new: dict, live: dict
) -> tuple[bool, str, dict, dict]:
    """The deploy gate on the `new` deployment row against the `live` one: whether it passes, why,
    the candidate's evaluation (materialization metadata) and the gate's numbers (check metadata).
    The lab evaluates both on the held-out puzzles; production passes here (its canary, opened by
    the caller, decides later) or, with the canary off, passes judging nothing."""
    if not lab.evaluated():
        canary = lab.canary_gate()
        numbers = {"gate": "off"} if canary is None else {"gate": "canary", **asdict(canary)}
        return True, NO_GATE, {"evaluation": NO_EVALUATION}, numbers
    candidate = evaluate_deployment(tables, lab, artifacts, new, new["round"])
    live_rows = stored_results(tables, live["deployment_id"]) or evaluate_deployment(
        tables, lab, artifacts, live, live["round"]
    )
    gate = deploy_gate(
        {r["puzzle_id"]: r["solved"] for r in candidate},
        {r["puzzle_id"]: r["solved"] for r in live_rows},
        lab.gate_margin,
        lab.gate_confidence,
    )
    numbers = {
        "candidate_rate": gate.candidate_rate,
        "live_rate": gate.live_rate,
        "diff": gate.diff,
        "upper_bound": gate.upper_bound,
        "margin": gate.margin,
        "paired_puzzles": gate.n,
    }
    return gate.passed, gate.reason(), {"heldout_solve_rate": solve_rate(candidate)}, numbers
