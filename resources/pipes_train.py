"""The trainer processes' side of Dagster Pipes: `torchrun ... -m resources.pipes_train <args of
prodrl_pipeline.rl.train_distributed>`. Every rank trains; rank 0 reports the round's metrics to
the `checkpoint` asset that launched it (PipesSubprocessClient locally, PipesK8sClient on a
cluster)."""

from __future__ import annotations

from dagster_pipes import open_dagster_pipes

from prodrl_pipeline.rl.train_distributed import run


def main() -> None:
    rows, rank, written = run()
    if rank == 0:
        with open_dagster_pipes() as pipes:
            pipes.log.info(f"trained {len(rows)} steps to global step {rows[-1]['step']}")
            pipes.report_asset_materialization(
                metadata={
                    "global_step": rows[-1]["step"],
                    "loss_last_step": rows[-1]["loss"],
                    "grad_norm_last_step": rows[-1]["grad_norm"],
                    "step_rows": {"raw_value": rows, "type": "json"},  # the asset's train_steps rows
                    "checkpoint_uri": written,  # on S3 the version below --out that was uploaded
                }
            )


if __name__ == "__main__":
    main()
