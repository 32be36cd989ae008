"""The fault suite's child: `python -m tests.faults.round_child ROOT` materializes round 1 of the
tiny lab on the instance in $DAGSTER_HOME and the store under ROOT (the base model must be built),
printing `ready` once its imports are done, so the parent can time its SIGKILL from there."""

from __future__ import annotations

import sys

from dagster import DagsterInstance, materialize

from assets.partitions import round_key
from tests.test_pipeline import ASSETS, ROUND, _resources

CHILD_LAB = {"steps": 3, "resume_every": 1}
"""Three steps, a resumable state after each: a kill inside training can resume."""


def main() -> None:
    resources = _resources(sys.argv[1], **CHILD_LAB)
    instance = DagsterInstance.get()
    print("ready", flush=True)
    instance.add_dynamic_partitions("rounds", [round_key(1)])
    result = materialize(
        ASSETS, selection=ROUND, partition_key=round_key(1), instance=instance, resources=resources
    )
    sys.exit(0 if result.success else 1)


if __name__ == "__main__":
    main()
