"""Train one round data-parallel with FSDP2 (rl/distributed.py), from the round's Delta tables:

    torchrun --nproc-per-node 2 -m prodrl_pipeline.rl.train_distributed \\
        --tables .prodrl/tables --round 3 --parent <checkpoint> --out <checkpoint> \\
        --trainer '{"steps": 16, "batch_size": 64}' --pad-id 0 --rows rows.json

Every rank reads the round's advantages and the calls of those trajectories, loads the parent
checkpoint and trains its share of each minibatch; rank 0 writes the new checkpoint in the
single-process layout (model, Adam state, meta) and the per-step metrics rows as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from prodrl_pipeline.artifacts import STORAGE_OPTIONS_ENV, Artifacts, storage_options_from_environment
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.checkpoint import LINEAGE_KEYS
from prodrl_pipeline.rl.distributed import DataParallel, load_sharded, save_consolidated
from prodrl_pipeline.rl.estimators import EstimatorConfig
from prodrl_pipeline.rl.recorded import RecordedCalls, trained_calls
from prodrl_pipeline.rl.trainer import TrainerConfig, train_round


def trainer_config(settings: dict) -> TrainerConfig:
    """A TrainerConfig from its dict form (as `dataclasses.asdict` writes it into checkpoint meta)."""
    estimator = EstimatorConfig(**settings.get("estimator", {}))
    return TrainerConfig(**{**settings, "estimator": estimator})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tables",
        required=True,
        help=f"the store's tables: a folder or s3:// URI (credentials: ${STORAGE_OPTIONS_ENV} or AWS_*)",
    )
    p.add_argument("--round", type=int, required=True)
    p.add_argument("--parent", required=True, help="the checkpoint to train from (a folder or s3:// URI)")
    p.add_argument(
        "--out", required=True, help="where rank 0 writes the new checkpoint (a folder or s3:// URI)"
    )
    p.add_argument("--trainer", default="{}", help="TrainerConfig fields as JSON")
    p.add_argument("--pad-id", type=int, required=True)
    p.add_argument("--behaviour-step", type=int, help="global step of the checkpoint that sampled the calls")
    p.add_argument("--rows", help="where rank 0 writes the per-step metrics as JSON")
    p.add_argument("--meta", default="{}", help="JSON merged into the new checkpoint's meta")
    return p


def run(argv: list[str] | None = None) -> tuple[list[dict], int, str | None]:
    """Train the round (collective); returns the per-step rows, this process's rank and, on rank
    0, where the checkpoint was written (on S3 a new version below --out)."""
    args = parser().parse_args(argv)
    dp = DataParallel.from_environment()
    try:
        cfg = trainer_config(json.loads(args.trainer))
        options = storage_options_from_environment(os.environ)
        store = DeltaStore(args.tables, storage_options=options)
        files = Artifacts(args.out, options)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one download per machine, into its cache
            files.local(args.parent)
        dist.barrier()
        parent = files.local(args.parent)
        advantages = store.read("advantages", args.round).to_pylist()
        calls = RecordedCalls.from_arrow(trained_calls(store.read("calls", args.round), advantages))
        model, optimizer, meta = load_sharded(parent, cfg, dp)
        rows = train_round(
            model,
            optimizer,
            calls,
            advantages,
            cfg,
            args.pad_id,
            first_step=meta["step"],
            behaviour_step=args.behaviour_step,
            dp=dp,
        )
        lineage = {key: meta.get(key) for key in LINEAGE_KEYS}
        out_meta = {**lineage, **json.loads(args.meta), "step": rows[-1]["step"], "data_parallel": dp.world}
        with files.writing(args.out) if dp.rank == 0 else contextlib.nullcontext() as upload:
            save_consolidated(upload and upload.folder, model, optimizer, out_meta, parent, dp)
        if dp.rank == 0 and args.rows:
            Path(args.rows).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()
    return rows, dp.rank, upload.uri if upload else None


if __name__ == "__main__":
    run()
