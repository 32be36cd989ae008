"""Ratios measured side by side in one run: the record every benchmark of `make bench` returns,
how it times its contenders (alternating, so slow drift of a noisy machine hits both), and the
table and JSON `python -m bench` writes.

A ratio's samples are one per repeat (each repeat times every contender once, in turn); the table
shows their median and range, the goal and whether the median meets it. A goal is a share of what a
user waits for (a round, the engine's serving time) or a cost a user pays (memory, a step); a
ratio without a goal is a figure, shown for what it says.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ratio:
    name: str
    """What is divided by what, e.g. "engine decode tokens/s / transformers generate"."""
    samples: tuple[float, ...]
    goal: float | None
    """None: a figure, shown without a verdict."""
    at_least: bool = True
    """True: the goal is a floor (>=); False: a ceiling (<=)."""
    detail: str = ""
    """The set-up in a few words (sizes, repeats)."""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def passed(self) -> bool | None:
        if self.goal is None:
            return None
        return self.median >= self.goal if self.at_least else self.median <= self.goal

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "samples": list(self.samples),
            "median": self.median,
            "low": min(self.samples),
            "high": max(self.samples),
            "passed": self.passed,
        }


def alternate(contenders: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each contender per repeat; each repeat runs every contender once, in turn."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


@contextmanager
def seconds_in(owner: object, *methods: str) -> Iterator[dict[str, float]]:
    """Seconds spent in these functions of `owner`, a class or a module (whichever are installed on
    entry) while the block runs: each is wrapped by a timer, not changed, and restored on exit."""
    spent = dict.fromkeys(methods, 0.0)
    originals = {name: getattr(owner, name) for name in methods}

    def timed(name: str) -> Callable:
        def call(*args, **kwargs):  # noqa: ANN002, ANN003
            t0 = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return call

    for name in methods:
        setattr(owner, name, timed(name))
    try:
        yield spent
    finally:
        for name, original in originals.items():
            setattr(owner, name, original)


def speedup(times: dict[str, list[float]], subject: str, baseline: str) -> tuple[float, ...]:
    """Per repeat: the subject's speed relative to the baseline's (baseline time / subject time)."""
    return tuple(b / s for s, b in zip(times[subject], times[baseline], strict=True))


def table(ratios: Sequence[Ratio]) -> str:
    width = max(len(r.name) for r in ratios)
    lines = [f"{'ratio':{width}s}  median  range          goal     result"]
    for r in ratios:
        goal = "" if r.goal is None else f"{'>=' if r.at_least else '<='} {r.goal:g}"
        result = {None: "figure", True: "pass", False: "FAIL"}[r.passed]
        lines.append(
            f"{r.name:{width}s}  {r.median:6.3f}  {min(r.samples):.3f}-{max(r.samples):<6.3f}  "
            f"{goal:7s}  {result}"
        )
    return "\n".join(lines)


def report(ratios: Sequence[Ratio], json_path: str | Path | None = None) -> None:
    """Print each ratio's set-up, then the table; write them as JSON if `json_path` is given."""
    for r in ratios:
        if r.detail:
            print(f"- {r.name}: {r.detail}")
    print(table(ratios))
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.as_dict() for r in ratios], indent=2) + "\n")
        print(f"written to {path}")
