"""Asset checks: token integrity of a round's traffic, advantage sanity, the mismatch monitor.
The logic lives in `prodrl_pipeline.records.checks`; these wrappers read the round's rows."""

from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from assets.advantages import advantages
from assets.checkpoint import checkpoint
from assets.partitions import ordered_keys, round_number, rounds
from assets.trajectories import trajectories
from prodrl_pipeline.records import checks
from resources.lab import LabResource
from resources.store import StoreResource


def _all_rounds(results: list[tuple[bool, dict]], keys: list[str]) -> AssetCheckResult:
    """A run over several rounds passes if every round does; metadata of the first failure (else last)."""
    failing = [(k, r) for k, r in zip(keys, results, strict=True) if not r[0]]
    key, (passed, meta) = failing[0] if failing else (keys[-1], results[-1])
    return AssetCheckResult(passed=passed, metadata={**meta, "round": key})


@asset_check(
    asset=trajectories,
    description="stored calls keep the data contract; every trajectory is scored",
    partitions_def=rounds,
)
def token_integrity(context: AssetCheckExecutionContext, store: StoreResource) -> AssetCheckResult:
    tables, keys = store.tables(), ordered_keys(context)
    return _all_rounds(
        [
            checks.token_integrity(
                tables.read("calls", round_number(k)), tables.read("trajectories", round_number(k))
            )
            for k in keys
        ],
        keys,
    )


@asset_check(
    asset=advantages,
    description="finite advantages, one per trajectory, zero sum per minibatch",
    partitions_def=rounds,
)
def advantage_sanity(context: AssetCheckExecutionContext, store: StoreResource) -> AssetCheckResult:
    tables, keys = store.tables(), ordered_keys(context)

    def one(k: int) -> tuple[bool, dict]:
        known = set(tables.read("trajectories", k).column("trajectory_id").to_pylist())
        return checks.advantage_sanity(tables.read("advantages", k).to_pylist(), known)

    return _all_rounds([one(round_number(k)) for k in keys], keys)


@asset_check(
    asset=checkpoint,
    description="mismatch above thresholds warns; a sustained rise fails",
    partitions_def=rounds,
)
def mismatch_monitor(
    context: AssetCheckExecutionContext, store: StoreResource, lab: LabResource
) -> AssetCheckResult:
    steps = [r for r in store.tables().read("train_steps").to_pylist() if r["experiment"] == lab.experiment]
    last = round_number(ordered_keys(context)[-1])  # the newest round of the run: the trend up to it
    passed, sustained, meta = checks.mismatch_monitor(steps, last, lab.mismatch_warn, lab.staleness_warn)
    severity = AssetCheckSeverity.ERROR if sustained else AssetCheckSeverity.WARN
    return AssetCheckResult(passed=passed and not sustained, severity=severity, metadata=meta)


CHECKS = [token_integrity, advantage_sanity, mismatch_monitor]
