"""Where everything lives: Delta tables, checkpoints and deployment exports under one root."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource

from prodrl_pipeline.records.store import DeltaStore


class StoreResource(ConfigurableResource):
    """Local folder by default; tables could live on object storage with the same code."""

    root: str = ".prodrl"
    """Root folder: tables/, checkpoints/, deployments/, reports/ below it."""
    tables_uri: str = ""
    """Where the Delta tables live instead of `<root>/tables`: another folder or an object-store
    URI (s3://bucket/prefix). Checkpoints and deployment exports stay under `root` (local)."""
    storage_options: dict[str, str] = {}
    """deltalake storage options for `tables_uri` (e.g. AWS_ENDPOINT_URL, AWS_REGION,
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; AWS_ALLOW_HTTP for a local server)."""

    def tables(self, run_id: str | None = None, partition: str | None = None) -> DeltaStore:
        meta = {k: v for k, v in (("dagster_run_id", run_id), ("partition", partition)) if v}
        root = self.tables_uri or f"{self.root}/tables"
        return DeltaStore(root, commit_metadata=meta, storage_options=self.storage_options)

    def path(self, *parts: str) -> Path:
        return Path(self.root, *parts)
