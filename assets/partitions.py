"""Rounds are dynamic partitions with zero-padded keys: r000001, r000002, ..."""

from __future__ import annotations

import re

from dagster import DynamicPartitionsDefinition

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
