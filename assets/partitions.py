"""Rounds are dynamic partitions with zero-padded keys: r000001, r000002, ..."""

from __future__ import annotations

import re

from dagster import DynamicPartitionsDefinition, MaterializeResult

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


def merged(results: list) -> MaterializeResult:
    """One MaterializeResult for a run over several rounds: the last round's metadata, plus the
    rounds covered; asset checks pass only if they passed for every round."""
    from dagster import MaterializeResult

    last = results[-1]
    checks = {}
    for r in results:
        for c in r.check_results or []:
            prev = checks.get(c.check_name)
            if prev is None or (prev.passed and not c.passed):
                checks[c.check_name] = c
    meta = {**(last.metadata or {}), **({"rounds_in_run": len(results)} if len(results) > 1 else {})}
    return MaterializeResult(metadata=meta, check_results=list(checks.values()) or None)
