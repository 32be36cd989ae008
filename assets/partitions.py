"""Rounds are dynamic partitions with zero-padded keys: r000001, r000002, ..."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import ExitStack

from dagster import (
    DynamicPartitionsDefinition,
    Failure,
    MarkdownMetadataValue,
    MaterializeResult,
    MetadataValue,
)

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


def lock_owner(run_id: str) -> str:
    """How a run names itself in the round locks it takes."""
    return f"run {run_id}"


def ordered_keys(context) -> list[str]:
    """The run's round partitions in round order (a single-run backfill hands an asset several)."""
    return sorted(context.partition_keys, key=round_number)


def each_round(
    context,
    store,
    experiment: str,
    one: Callable[[str], MaterializeResult],
    run_level: frozenset[str] = frozenset(),
) -> MaterializeResult:
    """`one(key)` for each of the run's rounds in order, each holding the lock of the experiment's
    round for the call (`StoreResource.round_lock`), merged into one result. A round another run of
    the experiment is writing fails the step at once, before that round is written, with a message
    naming that run."""
    results = []
    for key in ordered_keys(context):
        with ExitStack() as held:
            try:
                held.enter_context(
                    store.round_lock(
                        experiment, key, lock_owner(context.run.run_id), f"step {context.op_def.name}"
                    )
                )
            except Busy as e:
                raise Failure(
                    description=f"round {key} of {experiment} is being written by {e}. This run stops "
                    "here; re-run it once that run has ended (what is stored is kept, a re-run reuses it)"
                ) from None
            results.append(one(key))
    return merged(ordered_keys(context), results, run_level)


def merged(keys: list[str], results: list[MaterializeResult], run_level: frozenset[str]) -> MaterializeResult:
    """One MaterializeResult for a run over one or several rounds; asset checks pass only if they
    passed for every round. Dagster stamps a ranged run's one result on each of its partitions, so
    its metadata holds no round's own value at the top level: `per_round` maps each round to its
    numbers, text, locations and Delta versions (its plots and tables are left out), beside the
    `run_level` entries (the run so far: its table and curves) as of the last round. The Plots tab
    keeps the values single-round runs recorded."""
    checks = {}
    for r in results:
        for c in r.check_results or []:
            prev = checks.get(c.check_name)
            if prev is None or (prev.passed and not c.passed):
                checks[c.check_name] = c
    if len(results) == 1:
        meta = results[0].metadata or {}
    else:
        last = results[-1].metadata or {}
        per_round = {
            key: _plain({k: v for k, v in (r.metadata or {}).items() if k not in run_level})
            for key, r in zip(keys, results, strict=True)
        }
        meta = {
            **{k: v for k, v in last.items() if k in run_level},  # the run so far, as of its last round
            "rounds_in_run": len(results),
            "per_round": MetadataValue.json(per_round),
        }
    return MaterializeResult(metadata=meta, check_results=list(checks.values()) or None)


def _plain(metadata: dict) -> dict:
    """A round's metadata as JSON values (NaN as null); markdown (plots, tables, queries) is left out."""
    out = {}
    for name, value in metadata.items():
        if isinstance(value, MarkdownMetadataValue):
            continue
        raw = value.value if isinstance(value, MetadataValue) else value
        if isinstance(raw, float) and math.isnan(raw):
            raw = None
        out[name] = raw if isinstance(raw, (bool, int, float, str, dict, list)) or raw is None else str(raw)
    return out
