"""theta_0 and its deployment mu_0: the lab builds the tiny model; production points at a checkpoint."""

import json
from dataclasses import asdict

from dagster import AssetExecutionContext, Failure, MaterializeResult, asset
from transformers import PreTrainedModel

from assets import metadata
from assets.evaluation import evaluate_deployment
from prodrl_pipeline.envs.lab_data import base_inputs_digest
from prodrl_pipeline.evals.gate import NO_EVALUATION
from prodrl_pipeline.evals.heldout import solve_rate, solve_rates_by_theme
from prodrl_pipeline.model import build_model, load_model, n_parameters
from prodrl_pipeline.quant.nvfp4 import export_deployment
from prodrl_pipeline.records.registry import (
    BASE,
    children,
    live_deployment,
    lookup,
    register_checkpoint,
    register_deployment,
    set_live,
)
from prodrl_pipeline.rl.checkpoint import META_FILE, save_checkpoint
from prodrl_pipeline.rl.warmstart import WarmStartConfig, solved_turns, warm_start
from resources.lab import LabResource
from resources.store import StoreResource


@asset(group_name="base", kinds={"pytorch", "delta"})
def base_model(context: AssetExecutionContext, store: StoreResource, lab: LabResource) -> MaterializeResult:
    """Build (or load) the base model, export its deployment, make it live if nothing is, and, in
    the lab, evaluate it on the held-out puzzles (round 0 of every curve). Production loads
    `base_checkpoint` with its own tokenizer and evaluates nothing (no production gate yet)."""
    tables = store.tables(context.run.run_id)
    tok = lab.tokenizer()
    source = lab.base_checkpoint or "tiny-qwen3"
    warm = lab.warm_start() if not lab.base_checkpoint else None
    meta = {
        "checkpoint_id": BASE,
        "round": 0,
        "step": 0,
        "source": source,
        "model": asdict(lab.tiny_model()),
        "vocab_size": len(tok),
        "warm_start": _warm_start_meta(warm),
        "data": None if lab.base_checkpoint else base_inputs_digest(lab.data_dir, lab.mode),
    }
    artifacts = store.artifacts()
    try:  # the registered base checkpoint's folder (on S3 a version of it) and its meta
        path = lookup(tables, "checkpoints", "checkpoint_id", BASE)["path"]
        stored_file = artifacts.local(path) / META_FILE
    except (KeyError, FileNotFoundError):
        path, stored_file = None, None
    stored = json.loads(stored_file.read_text()) if stored_file and stored_file.exists() else None
    cached = stored == meta
    if stored is not None and not cached and (trained := children(tables, BASE)):
        changed = sorted(k for k in meta.keys() | stored.keys() if meta.get(k) != stored.get(k))
        raise Failure(
            f"the base model's settings changed ({', '.join(changed)}) but {len(trained)} checkpoint(s) "
            f"were trained from the stored base ({trained[0]}, ...): rebuilding it would change round 0 "
            "under them. Use another store root (or `make clean`), or restore the settings."
        )
    warm_rows: list[dict] = []
    if cached or lab.base_checkpoint:
        model = load_model(stored_file.parent if cached else lab.base_checkpoint)
    else:
        model = build_model(lab.tiny_model(), len(tok), tok.pad_token_id)
        warm_rows = _warm_start(context, lab, model, warm)
    if not cached:
        with artifacts.writing(artifacts.uri("checkpoints", BASE)) as upload:
            save_checkpoint(upload.folder, model, None, meta)
        path = upload.uri
    register_checkpoint(
        tables, checkpoint_id=BASE, round_=0, experiment="", parent_id=None, path=path, step=0
    )
    with artifacts.writing(artifacts.uri("deployments", BASE)) as upload:
        export_deployment(model, upload.folder, lab.quant_format)
    deploy_path = upload.uri
    register_deployment(
        tables,
        deployment_id=BASE,
        round_=0,
        checkpoint_id=BASE,
        path=deploy_path,
        quant_format=lab.quant_format,
        sampling_json=json.dumps(asdict(lab.sampling())),
    )
    if live_deployment(tables) is None:
        set_live(tables, BASE)
    if lab.evaluated():
        results = evaluate_deployment(
            tables, lab, artifacts, lookup(tables, "deployments", "deployment_id", BASE), 0
        )
        evaluation = {
            "heldout_solve_rate": solve_rate(results),
            **{f"heldout_solve_rate_{theme}": rate for theme, rate in solve_rates_by_theme(results).items()},
            "heldout_puzzles": len(results),
        }
        judged = f"held-out solve rate {solve_rate(results):.3f}"
    else:
        evaluation, judged = {"evaluation": NO_EVALUATION}, f"evaluation {NO_EVALUATION}"
    context.log.info(f"base model: {n_parameters(model):,} parameters, {judged}")
    return MaterializeResult(
        metadata={
            "parameters": n_parameters(model),
            "vocab_size": len(tok),
            "source": source,
            "cached": cached,
            "checkpoint_path": path,
            "deployment_path": deploy_path,
            "quant_format": lab.quant_format,
            **evaluation,
            **_warm_start_metadata(warm_rows),
            "live_deployment": live_deployment(tables)["deployment_id"],
        }
    )


def _warm_start_meta(cfg: WarmStartConfig | None) -> dict | None:
    """The warm start's settings as the base's meta records them; a constant schedule and no copy
    pre-training are left out, as before they were settings, so that a store's base built then is
    still the same base."""
    if cfg is None:
        return None
    meta = asdict(cfg)
    if meta["schedule"] == "constant":
        del meta["schedule"]
    if meta["copy_steps"] == 0:
        del meta["copy_steps"]
    return meta


def _warm_start(
    context: AssetExecutionContext, lab: LabResource, model: PreTrainedModel, cfg: WarmStartConfig
) -> list[dict]:
    if cfg.steps == 0 and cfg.copy_steps == 0:
        return []
    tok = lab.tokenizer()
    puzzles = cfg.demonstrations(lab.puzzles("warmup"))
    turns = solved_turns(tok, puzzles, lab.mode)
    context.log.info(
        (f"induction pre-training: {cfg.copy_steps} steps; then " if cfg.copy_steps else "")
        + f"warm start: {cfg.steps} steps of {cfg.batch_size} over {len(turns)} solved turns "
        f"of {len(puzzles)} warmup puzzles"
    )

    def progress(row: dict) -> None:
        if row["step"] % 25 == 0 or row["step"] == cfg.steps:
            context.log.info(
                f"warm start step {row['step']}/{cfg.steps}: loss {row['loss']:.3f} "
                f"mean pi(solution) {row['solution_prob']:.3f}"
            )

    return warm_start(model, turns, cfg, tok.pad_token_id, progress)


def _warm_start_metadata(rows: list[dict]) -> dict:
    if not rows:
        return {}
    return {
        "warm_start_final_loss": rows[-1]["loss"],
        "warm_start_seconds": sum(r["seconds"] for r in rows),
        "warm_start_plot": metadata.plot(
            [r["step"] for r in rows],
            {"loss": [r["loss"] for r in rows], "mean pi(solution move)": [r["solution_prob"] for r in rows]},
            "step",
            "supervised warm start",
        ),
    }
