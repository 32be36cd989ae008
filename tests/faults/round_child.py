"""The fault suite's child: `python -m tests.faults.round_child ROOT [K | FIRST LAST]` materializes
round K (default 1) of the tiny lab, or replays rounds FIRST..LAST in one ranged run, on the instance in
$DAGSTER_HOME and the store under ROOT (the base model must be built), printing `ready` once its
imports are done, so the parent can time its SIGKILL from there. With
KILL_AFTER set it SIGKILLs itself right after that commit lands: `checkpoints` (the checkpoint
registered, its resumable state not yet cleared), `deployments` (the export registered, live not
moved) or `live` (live moved to the round's deployment, the evaluation not run)."""

from __future__ import annotations

import os
import signal
import sys

from dagster import DagsterInstance, materialize
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from assets.partitions import round_key
from prodrl_pipeline.records.store import DeltaStore
from tests.test_pipeline import ASSETS, ROUND, _resources

CHILD_LAB = {"steps": 3, "resume_every": 1}
"""Three steps, a resumable state after each: a kill inside training can resume."""


def _die_after(commit: str) -> None:
    """Patch the store so that the process is SIGKILLed right after `commit` lands: an overwrite
    of that table, or for `live` the registry's compare-and-set update of `deployments`."""
    method, table = ("update", "deployments") if commit == "live" else ("overwrite", commit)
    original = getattr(DeltaStore, method)

    def committed(self, name, *args, **kwargs):  # noqa: ANN001, ANN202
        out = original(self, name, *args, **kwargs)
        if name == table:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(DeltaStore, method, committed)


def main() -> None:
    if commit := os.environ.get("KILL_AFTER"):
        _die_after(commit)
    resources = _resources(sys.argv[1], **CHILD_LAB)
    instance = DagsterInstance.get()
    print("ready", flush=True)
    rounds = [round_key(int(a)) for a in sys.argv[2:]] or [round_key(1)]
    if len(rounds) == 2:  # a replay: the rounds' stored traffic, re-derived in one ranged run
        tags = {ASSET_PARTITION_RANGE_START_TAG: rounds[0], ASSET_PARTITION_RANGE_END_TAG: rounds[1]}
        which = {"selection": ROUND[1:], "tags": tags}
    else:
        instance.add_dynamic_partitions("rounds", rounds)
        which = {"selection": ROUND, "partition_key": rounds[0]}
    result = materialize(ASSETS, **which, instance=instance, resources=resources, raise_on_error=False)
    sys.exit(0 if result.success else 1)


if __name__ == "__main__":
    main()
