"""Rounds are dynamic partitions with zero-padded keys: r000001, r000002, ..."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime

from dagster import DynamicPartitionsDefinition, Failure, MaterializeResult

from prodrl_pipeline.locks import Busy

rounds = DynamicPartitionsDefinition(name="rounds")
ROUND_KEY = re.compile(r"r(\d{6})")


def round_key(number: int) -> str:
    if number < 1:
        raise ValueError(f"rounds start at 1 (round 0 is the base model), got {number}")
    return f"r{number:06d}"


def round_number(key: str) -> int:
    match = ROUND_KEY.fullmatch(key)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"round partition keys look like 'r000001', got {key!r}")
    return int(match.group(1))


def ordered_keys(context) -> list[str]:
    """The run's round partitions in round order (a single-run backfill hands an asset several)."""
    return sorted(context.partition_keys, key=round_number)


def each_round(context, store, experiment: str, one: Callable[[str], MaterializeResult]) -> MaterializeResult:
    """`one(key)` for each of the run's rounds in order, each holding the lock of the experiment's
    round for the call (`StoreResource.round_lock`), merged into one result. A round another run of
    the experiment is writing fails the step at once, before that round is written, with a message
    naming that run."""
    holder = (
        f"run {context.run.run_id} (step {context.op_def.name}, pid {os.getpid()} on "
        f"{socket.gethostname()}, since {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC)"
    )
    results = []
    for key in ordered_keys(context):
        with ExitStack() as held:
            try:
                held.enter_context(store.round_lock(experiment, key, holder))
            except Busy as e:
                raise Failure(
                    description=f"round {key} of {experiment} is being written by {e}. This run stops "
                    "here; re-run it once that run has ended (what is stored is kept, a re-run reuses it)"
                ) from None
            results.append(one(key))
    return merged(results)


def merged(results: list) -> MaterializeResult:
    """One MaterializeResult for a run over several rounds: the last round's metadata, plus the
    rounds covered; asset checks pass only if they passed for every round."""
    last = results[-1]
    checks = {}
    for r in results:
        for c in r.check_results or []:
            prev = checks.get(c.check_name)
            if prev is None or (prev.passed and not c.passed):
                checks[c.check_name] = c
    meta = {**(last.metadata or {}), **({"rounds_in_run": len(results)} if len(results) > 1 else {})}
    return MaterializeResult(metadata=meta, check_results=list(checks.values()) or None)
