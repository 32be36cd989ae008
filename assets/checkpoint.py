"""theta_{k+1}: S Adam steps from theta_k, with the optimizer state carried from the parent."""

from dataclasses import asdict

from dagster import AssetExecutionContext, MaterializeResult, asset

from assets import metadata
from assets.advantages import advantages
from assets.partitions import round_number, rounds
from prodrl_pipeline.records.registry import lookup, register_checkpoint, round_id
from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from prodrl_pipeline.rl.trainer import make_optimizer, train_round
from resources.lab import LabResource
from resources.store import StoreResource

STEP_COLUMNS = [
    "step",
    "reward_mean",
    "loss",
    "grad_norm",
    "entropy",
    "engine_mismatch",
    "staleness",
    "seconds",
]


@asset(partitions_def=rounds, deps=[advantages], group_name="round", kinds={"pytorch", "delta"})
def checkpoint(context: AssetExecutionContext, store: StoreResource, lab: LabResource) -> MaterializeResult:
    """Train the round. The parent is the checkpoint behind the deployment that served the round's
    trajectories (lineage is data: `deployment_id` on every trajectory row)."""
    k = round_number(context.partition_key)
    tables = store.tables(context.run.run_id, context.partition_key)
    served_by = set(tables.read("trajectories", k).column("deployment_id").to_pylist())
    if len(served_by) != 1:
        raise RuntimeError(f"round {k}: expected trajectories from one deployment, found {sorted(served_by)}")
    deployment = lookup(tables, "deployments", "deployment_id", served_by.pop())
    parent = lookup(tables, "checkpoints", "checkpoint_id", deployment["checkpoint_id"])
    model, optimizer_state, parent_meta = load_checkpoint(parent["path"])
    cfg = lab.trainer()
    optimizer = make_optimizer(model, cfg, optimizer_state)
    calls = tables.read("calls", k).to_pylist()
    adv = tables.read("advantages", k).to_pylist()
    context.log.info(f"round {k}: {cfg.steps} steps of {cfg.batch_size} from {parent['checkpoint_id']}")

    def progress(row: dict) -> None:
        context.log.info(
            f"round {k} step {row['step']}: reward {row['reward_mean']:.3f} loss {row['loss']:.4f} "
            f"|log pi_k - log mu| {row['engine_mismatch']:.4f} |log pi - log pi_k| {row['staleness']:.4f}"
        )

    rows = train_round(
        model,
        optimizer,
        calls,
        adv,
        cfg,
        lab.tokenizer().pad_token_id,
        first_step=parent_meta["step"],
        progress=progress,
    )
    ckpt_id = round_id(lab.experiment, k)
    path = store.path("checkpoints", lab.experiment, context.partition_key)
    meta = {
        "checkpoint_id": ckpt_id,
        "round": k,
        "experiment": lab.experiment,
        "parent_id": parent["checkpoint_id"],
        "step": rows[-1]["step"],
        "trainer": asdict(cfg),
        "model": parent_meta.get("model"),
        "source": parent_meta.get("source"),
        "vocab_size": parent_meta.get("vocab_size"),
        "read_versions": {t: tables.table(t).version() for t in ("calls", "trajectories", "advantages")},
        "dagster_run_id": context.run.run_id,
    }
    save_checkpoint(path, model, optimizer.state_dict(), meta)
    register_checkpoint(
        tables,
        checkpoint_id=ckpt_id,
        round_=k,
        experiment=lab.experiment,
        parent_id=parent["checkpoint_id"],
        path=str(path),
        step=meta["step"],
    )
    tables.overwrite(
        "train_steps",
        [{**r, "round": k, "experiment": lab.experiment} for r in rows],
        f"round = {k} AND experiment = '{lab.experiment}'",
    )
    steps = [r["step"] for r in rows]
    return MaterializeResult(
        metadata={
            "checkpoint_id": ckpt_id,
            "parent_id": parent["checkpoint_id"],
            "path": str(path),
            "global_step": meta["step"],
            "estimator": cfg.estimator,
            "engine_mismatch": sum(r["engine_mismatch"] for r in rows) / len(rows),
            "staleness_last_step": rows[-1]["staleness"],
            "steps": metadata.table(rows, STEP_COLUMNS),
            "mismatch_plot": metadata.plot(
                steps,
                {
                    "|log pi_k - log mu| (engine)": [r["engine_mismatch"] for r in rows],
                    "|log pi - log pi_k| (staleness)": [r["staleness"] for r in rows],
                },
                "optimizer step",
                f"round {k}: mismatch per step",
            ),
        }
    )
