"""Jobs: build the base model; run one round (all five per-round assets of one partition)."""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job

base_job = define_asset_job("base_job", selection=AssetSelection.assets("base_model"))
round_job = define_asset_job(
    "round_job",
    selection=AssetSelection.assets("trajectories", "advantages", "checkpoint", "deployment", "eval_report"),
)
