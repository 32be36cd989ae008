"""Jobs: build the base model; run one round (all five per-round assets of one partition)."""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job, in_process_executor

# A round's steps run one after another in the run's own process: a process per step (Dagster's
# default) re-imports torch and the code location for each, 15-40 s a step on 2 cores. The
# `trainer` pool still serializes training across runs (in-process steps claim pool slots too).
base_job = define_asset_job(
    "base_job", selection=AssetSelection.assets("base_model"), executor_def=in_process_executor
)
round_job = define_asset_job(
    "round_job",
    selection=AssetSelection.assets("trajectories", "advantages", "checkpoint", "deployment", "eval_report"),
    executor_def=in_process_executor,
)
