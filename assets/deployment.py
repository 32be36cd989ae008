"""mu_{k+1}: the round's checkpoint exported (NVFP4), registered and made live."""

import json
from dataclasses import asdict

from dagster import AssetExecutionContext, MaterializeResult, asset

from assets.checkpoint import checkpoint
from assets.partitions import round_number, rounds
from prodrl_pipeline.quant.nvfp4 import export_deployment, weight_error
from prodrl_pipeline.records.registry import lookup, register_deployment, round_id
from prodrl_pipeline.rl.checkpoint import load_checkpoint
from resources.lab import LabResource
from resources.store import StoreResource


@asset(partitions_def=rounds, deps=[checkpoint], group_name="round", kinds={"pytorch", "delta"})
def deployment(context: AssetExecutionContext, store: StoreResource, lab: LabResource) -> MaterializeResult:
    """Quantize and register the round's checkpoint; moving the live pointer is the last act."""
    k = round_number(context.partition_key)
    tables = store.tables(context.run.run_id, context.partition_key)
    ckpt = lookup(tables, "checkpoints", "checkpoint_id", round_id(lab.experiment, k))
    model, _, _ = load_checkpoint(ckpt["path"])
    dep_id = round_id(lab.experiment, k)
    path = store.path("deployments", lab.experiment, context.partition_key)
    export_deployment(model, path, lab.quant_format)
    register_deployment(
        tables,
        deployment_id=dep_id,
        round_=k,
        checkpoint_id=ckpt["checkpoint_id"],
        path=str(path),
        quant_format=lab.quant_format,
        sampling_json=json.dumps(asdict(lab.sampling())),
    )
    previous = tables.live_deployment()
    tables.set_live(dep_id)
    context.log.info(f"round {k}: deployment {dep_id} is live (was {previous and previous['deployment_id']})")
    return MaterializeResult(
        metadata={
            "deployment_id": dep_id,
            "checkpoint_id": ckpt["checkpoint_id"],
            "path": str(path),
            "quant_format": lab.quant_format,
            "previous_live": previous["deployment_id"] if previous else "",
            "export_bytes": sum(f.stat().st_size for f in path.iterdir()),
            "weight_rel_error": weight_error(model, path),
        }
    )
