"""theta_{k+1}: S Adam steps from theta_k, with the optimizer state carried from the parent."""

from dataclasses import asdict
from pathlib import Path

from dagster import (
    AssetExecutionContext,
    BackfillPolicy,
    Config,
    Failure,
    MaterializeResult,
    asset,
)

from assets import metadata
from assets.advantages import advantages
from assets.partitions import each_round, round_number, rounds
from assets.torchrun import train_with_torchrun
from prodrl_pipeline.quant.nvfp4 import load_deployment
from prodrl_pipeline.records.registry import lookup, register_checkpoint, round_id
from prodrl_pipeline.rl.checkpoint import LINEAGE_KEYS, load_checkpoint, save_checkpoint
from prodrl_pipeline.rl.recorded import RecordedCalls, trained_calls
from prodrl_pipeline.rl.resume import (
    clear_state,
    data_digest,
    load_state,
    logprobs_table,
    save_state,
    stored_pi_k,
)
from prodrl_pipeline.rl.retokenize import retokenize_calls
from prodrl_pipeline.rl.trainer import make_optimizer, policy_logprobs, train_round
from prodrl_pipeline.rounds import parent_checkpoint
from resources.lab import EstimatorSettings, LabResource
from resources.store import StoreResource

"""The repository root: the trainer processes run `-m resources.pipes_train` from it."""

STEP_COLUMNS = [
    "policy_lag_steps",
    "step",
    "reward_mean",
    "loss",
    "lr",
    "grad_norm",
    "entropy",
    "engine_mismatch",
    "staleness",
    "clip_fraction",
    "rho_truncated_fraction",
    "kl",
    "dropped_trajectories",
    "seconds",
]


class CheckpointConfig(Config):
    estimator: EstimatorSettings | None = None
    """Override the resource's default estimator for this run (recorded in the checkpoint)."""


@asset(
    partitions_def=rounds,
    deps=[advantages],
    group_name="round",
    kinds={"pytorch", "delta"},
    pool="trainer",
    backfill_policy=BackfillPolicy.single_run(),
)
def checkpoint(
    context: AssetExecutionContext, config: CheckpointConfig, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    """Train the round. The parent is the checkpoint behind the deployment that served the round's
    trajectories (lineage is data: `deployment_id` on every trajectory row)."""
    return each_round(
        context, store, lab.experiment, lambda key: _checkpoint_round(context, key, config, store, lab)
    )


def _checkpoint_round(
    context: AssetExecutionContext, key: str, config: CheckpointConfig, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    k = round_number(key)
    tables = store.tables(context.run.run_id, key)
    try:
        cfg = lab.trainer(config.estimator)
    except ValueError as e:
        raise Failure(description=f"invalid trainer configuration: {e}") from e
    served_by = set(tables.read("trajectories", k).column("deployment_id").to_pylist())
    if len(served_by) != 1:
        raise Failure(
            description=f"round {k}: expected trajectories from one deployment, found {sorted(served_by)}"
        )
    deployment = lookup(tables, "deployments", "deployment_id", served_by.pop())
    parent_id = parent_checkpoint(
        schedule=lab.schedule,
        counterfactual=lab.counterfactual,
        experiment=lab.experiment,
        round_=k,
        served_checkpoint=deployment["checkpoint_id"],
    )
    try:
        parent = lookup(tables, "checkpoints", "checkpoint_id", parent_id)
    except KeyError as e:
        raise Failure(description=f"round {k} trains from {parent_id}, which is not registered: {e}") from e
    behaviour_step = lookup(tables, "checkpoints", "checkpoint_id", deployment["checkpoint_id"])["step"]
    ckpt_id = round_id(lab.experiment, k)
    artifacts = store.artifacts()
    path = artifacts.uri("checkpoints", lab.experiment, key)
    meta = {
        "checkpoint_id": ckpt_id,
        "round": k,
        "experiment": lab.experiment,
        "parent_id": parent["checkpoint_id"],
        "trainer": asdict(cfg),
        "read_versions": {t: tables.table(t).version() for t in ("calls", "trajectories", "advantages")},
        "dagster_run_id": context.run.run_id,
    }
    est = cfg.estimator
    context.log.info(
        f"round {k}: {cfg.steps} x {cfg.batch_size} with {est.type} from {parent['checkpoint_id']}"
    )
    retokenized: dict = {}
    extra: dict = {}
    partial = Path(store.root, "partial", lab.experiment, key)  # the in-process trainer's resumable state
    if lab.trainer_image:  # the pod reads the parent and writes the checkpoint on the object store
        rows, extra, path = train_with_torchrun(
            context, lab, cfg, store, k, parent["path"], path, meta, behaviour_step, _progress
        )
    else:
        parent_path = artifacts.local(parent["path"])
        reference = artifacts.local(deployment["path"]) if est.type == "ref_is" else None
        with artifacts.writing(path) as upload:
            if lab.trainer_processes:
                rows, extra, _ = train_with_torchrun(
                    context,
                    lab,
                    cfg,
                    store,
                    k,
                    str(parent_path),
                    str(upload.folder),
                    meta,
                    behaviour_step,
                    _progress,
                )
            else:
                rows, retokenized = _train_in_process(
                    context,
                    lab,
                    cfg,
                    tables,
                    k,
                    parent_path,
                    upload.folder,
                    meta,
                    reference,
                    behaviour_step,
                    partial,
                )
        path = upload.uri
    register_checkpoint(
        tables,
        checkpoint_id=ckpt_id,
        round_=k,
        experiment=lab.experiment,
        parent_id=parent["checkpoint_id"],
        path=path,
        step=rows[-1]["step"],
    )
    clear_state(partial)  # resuming is over once the checkpoint is registered
    tables.overwrite(
        "train_steps",
        [{**r, "round": k, "experiment": lab.experiment} for r in rows],
        f"round = {k} AND experiment = '{lab.experiment}'",
    )
    steps = [r["step"] for r in rows]
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return MaterializeResult(
        metadata={
            "checkpoint_id": ckpt_id,
            "parent_id": parent["checkpoint_id"],
            "path": metadata.location(path),
            "global_step": rows[-1]["step"],
            **extra,
            "estimator": est.type,
            "estimator_config": asdict(est),
            "engine_mismatch": mean("engine_mismatch"),
            "staleness_last_step": rows[-1]["staleness"],
            "clip_fraction": mean("clip_fraction"),
            "rho_truncated_fraction": mean("rho_truncated_fraction"),
            "kl": mean("kl"),
            "dropped_trajectories": sum(r["dropped_trajectories"] for r in rows),
            "tokens": cfg.tokens,
            **metadata.lineage(tables),
            **({"retokenization": retokenized} if retokenized else {}),
            "steps": metadata.table(rows, STEP_COLUMNS),
            "mismatch_plot": metadata.plot(
                steps,
                {
                    "|log pi_k - log mu| (engine)": [r["engine_mismatch"] for r in rows],
                    "|log pi - log pi_k| (staleness)": [r["staleness"] for r in rows],
                    "|log pi - log mu| (total)": [r["total_mismatch"] for r in rows],
                },
                "optimizer step",
                f"round {k}: mismatch per step",
            ),
            "correction_plot": metadata.plot(
                steps,
                {
                    "clip fraction": [r["clip_fraction"] for r in rows],
                    "rho truncation fraction": [r["rho_truncated_fraction"] for r in rows],
                    "KL(pi || pi_k) estimate": [r["kl"] for r in rows],
                },
                "optimizer step",
                f"round {k}: corrections per step",
            ),
        }
    )


def _train_in_process(
    context, lab, cfg, tables, k, parent_path, path, meta, reference_path, behaviour_step, partial
):  # noqa: ANN001, ANN202, PLR0913
    """S steps in this process; writes pi_k to `policy_logprobs` and the checkpoint to `path`
    (`reference_path`: the behaviour deployment's folder, for ref_is). Every `cfg.resume_every`
    steps the state is saved in `partial`, and a re-run of the same round continues from it."""
    model, optimizer_state, parent_meta = load_checkpoint(parent_path)
    model.to(cfg.device)
    optimizer = make_optimizer(model, cfg, optimizer_state)
    pad = lab.pad_id()
    adv = tables.read("advantages", k).to_pylist()
    stored_calls = trained_calls(tables.read("calls", k), adv)
    retokenized: dict = {}
    if cfg.tokens == "retokenized":
        rows, retokenized = retokenize_calls(stored_calls.to_pylist(), lab.tokenizer())
        calls = RecordedCalls.from_rows(rows, lab.tokenizer())
        context.log.info(f"round {k}: trains on retokenized calls: {retokenized}")
    else:
        calls = RecordedCalls.from_arrow(stored_calls, lab.tokenizer())  # replays grammar calls' masks
    weights = Path(parent_path, "model.safetensors").stat()
    fingerprint = {  # what the round trains from: its parent (this very file: a re-trained parent is
        "parent_id": meta["parent_id"],  # rewritten at the same path), its config, its data (not
        "parent": [str(parent_path), weights.st_size, weights.st_mtime_ns],  # table versions: a
        "trainer": {k: v for k, v in meta["trainer"].items() if k not in ("device", "resume_every")},
        "data": data_digest(calls, adv),  # re-run rewrites the same advantages as a new version)
    }
    state = load_state(partial, fingerprint)
    if state is not None:  # pi_k and the reference as stored before the first step
        stored = stored_pi_k(
            tables.read("policy_logprobs", k),
            lab.experiment,
            calls,
            with_reference=reference_path is not None,
        )
        if stored is None:
            state = None  # pi_k was not kept (another trainer ran the round since): start over
        else:
            round_start, reference = stored
    if state is not None:
        model.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        context.log.info(f"round {k}: resumed after {state.cursor} of {cfg.steps} steps")
    else:
        clear_state(partial)  # pi_k is rewritten below: no older state may resume against it
        round_start = policy_logprobs(model, calls, cfg, pad, fake_quant=cfg.qat)
        reference = (
            policy_logprobs(load_deployment(reference_path), calls, cfg, pad, fake_quant=False)
            if reference_path is not None
            else None
        )
        tables.overwrite(
            "policy_logprobs",
            logprobs_table(calls.call_id, round_start, reference, k, lab.experiment),
            f"round = {k} AND experiment = '{lab.experiment}'",
        )
    done = state.rows if state is not None else []

    def save(trained_minibatches: int, rows: list[dict]) -> None:
        if (
            cfg.resume_every
            and trained_minibatches % cfg.resume_every == 0
            and trained_minibatches < cfg.steps
        ):
            save_state(partial, model, optimizer, trained_minibatches, done + rows, fingerprint)

    rows = done + train_round(
        model,
        optimizer,
        calls,
        adv,
        cfg,
        pad,
        first_step=parent_meta["step"],
        round_start=round_start,
        reference=reference,
        behaviour_step=behaviour_step,
        progress=lambda row: _progress(context, k, row),
        start_minibatch=state.cursor if state is not None else 0,
        after_step=save,
    )
    lineage = {key: parent_meta.get(key) for key in LINEAGE_KEYS}
    model.to("cpu")
    resumed = {"resumed_after_steps": state.cursor} if state is not None else {}
    save_checkpoint(
        path, model, optimizer.state_dict(), {**meta, **lineage, **resumed, "step": rows[-1]["step"]}
    )
    return rows, retokenized  # the caller clears `partial` once the checkpoint is registered


def _progress(context: AssetExecutionContext, k: int, row: dict) -> None:
    context.log.info(
        f"round {k} step {row['step']}: reward {row['reward_mean']:.3f} loss {row['loss']:.4f} "
        f"|log pi_k - log mu| {row['engine_mismatch']:.4f} |log pi - log pi_k| {row['staleness']:.4f} "
        f"clip {row['clip_fraction']:.3f} kl {row['kl']:.5f}"
    )
