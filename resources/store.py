"""Where everything lives: Delta tables, checkpoints and deployment exports under one root."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource

from prodrl_pipeline.records.store import DeltaStore


class StoreResource(ConfigurableResource):
    """Local folder by default; tables could live on object storage with the same code."""

    root: str = ".prodrl"
    """Root folder: tables/, checkpoints/, deployments/, reports/ below it."""

    def tables(self, run_id: str | None = None, partition: str | None = None) -> DeltaStore:
        meta = {k: v for k, v in (("dagster_run_id", run_id), ("partition", partition)) if v}
        return DeltaStore(f"{self.root}/tables", commit_metadata=meta)

    def path(self, *parts: str) -> Path:
        return Path(self.root, *parts)
