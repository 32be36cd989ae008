"""Where everything lives: Delta tables, checkpoints and deployment exports under one root."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from dagster import ConfigurableResource

from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.locks import Holder, holder, holding
from prodrl_pipeline.records.store import DeltaStore


class StoreResource(ConfigurableResource):
    """A local folder by default; tables, checkpoints and exports can each live on object storage."""

    root: str = ".prodrl"
    """Root folder: tables/, checkpoints/, deployments/, cache/ below it unless moved."""
    tables_uri: str = ""
    """Where the Delta tables live instead of `<root>/tables`: another folder or an object-store
    URI (s3://bucket/prefix)."""
    artifacts_uri: str = ""
    """Where checkpoints/ and deployments/ live instead of `root`: another folder or s3://bucket/prefix
    (downloaded copies are cached under `<root>/cache`)."""
    storage_options: dict[str, str] = {}
    """Object-store options for both URIs (e.g. AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY; AWS_ALLOW_HTTP for a local server)."""

    def tables(self, run_id: str | None = None, partition: str | None = None) -> DeltaStore:
        meta = {k: v for k, v in (("dagster_run_id", run_id), ("partition", partition)) if v}
        root = self.tables_uri or f"{self.root}/tables"
        return DeltaStore(root, commit_metadata=meta, storage_options=self.storage_options, lineage=True)

    def artifacts(self) -> Artifacts:
        return Artifacts(self.artifacts_uri or self.root, self.storage_options, Path(self.root, "cache"))

    def round_lock(self, experiment: str, key: str, owner: str, task: str) -> AbstractContextManager[None]:
        """Exclusive hold on round `key` of `experiment` for one step of one run, or `locks.Busy`
        naming its holder (`<root>/locks/<experiment>/<key>.lock`): two runs of one round never write
        it at once, while a counterfactual replay (another experiment) runs beside it. It guards the
        runs that share this machine's root; across machines the run queue's per-partition limit does."""
        return holding(Path(self.root, "locks", experiment, f"{key}.lock"), owner, task)

    def round_holders(self) -> dict[tuple[str, str], Holder]:
        """(experiment, round key) -> the process that holds that round's lock, or held it last."""
        files = sorted(Path(self.root, "locks").glob("*/*.lock"))
        return {(f.parent.name, f.stem): h for f in files if (h := holder(f)) is not None}
