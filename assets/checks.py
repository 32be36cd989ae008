"""Asset checks: token integrity of a round's traffic, advantage sanity, the mismatch monitor.
The logic lives in `prodrl_pipeline.records.checks`; these wrappers read the round's rows."""

from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from assets.advantages import advantages
from assets.checkpoint import checkpoint
from assets.partitions import round_number
from assets.trajectories import trajectories
from prodrl_pipeline.records import checks
from resources.lab import LabResource
from resources.store import StoreResource


@asset_check(
    asset=trajectories, description="stored calls keep the data contract; every trajectory is scored"
)
def token_integrity(context: AssetCheckExecutionContext, store: StoreResource) -> AssetCheckResult:
    k = round_number(context.partition_key)
    tables = store.tables()
    passed, meta = checks.token_integrity(
        tables.read("calls", k).to_pylist(), tables.read("trajectories", k).to_pylist()
    )
    return AssetCheckResult(passed=passed, metadata=meta)


@asset_check(asset=advantages, description="finite advantages, one per trajectory, zero sum per minibatch")
def advantage_sanity(context: AssetCheckExecutionContext, store: StoreResource) -> AssetCheckResult:
    k = round_number(context.partition_key)
    tables = store.tables()
    known = set(tables.read("trajectories", k).column("trajectory_id").to_pylist())
    passed, meta = checks.advantage_sanity(tables.read("advantages", k).to_pylist(), known)
    return AssetCheckResult(passed=passed, metadata=meta)


@asset_check(asset=checkpoint, description="mismatch above thresholds warns; a sustained rise fails")
def mismatch_monitor(
    context: AssetCheckExecutionContext, store: StoreResource, lab: LabResource
) -> AssetCheckResult:
    steps = [r for r in store.tables().read("train_steps").to_pylist() if r["experiment"] == lab.experiment]
    passed, sustained, meta = checks.mismatch_monitor(
        steps, round_number(context.partition_key), lab.mismatch_warn, lab.staleness_warn
    )
    severity = AssetCheckSeverity.ERROR if sustained else AssetCheckSeverity.WARN
    return AssetCheckResult(passed=passed and not sustained, severity=severity, metadata=meta)


CHECKS = [token_integrity, advantage_sanity, mismatch_monitor]
