"""`make bench`: every side-by-side ratio in one table, also written as JSON.

Runs each benchmark module's `measure` with its default arguments (or its `SMOKE` arguments with
`--smoke`: a tiny run that checks the benchmarks work, not their figures) and prints one table: per
ratio its median and range over the repeats, the goal and pass/FAIL. docs/performance.md explains
each ratio and what the measured figures say. Run: `make bench` (or `.venv/bin/python -m bench`).
"""

from __future__ import annotations

import argparse
import time

from bench import (
    delta_io,
    engine,
    estimators,
    grammar,
    logprob_memory,
    record_bytes,
    round,
    trainer,
    vocab_scale,
)
from bench.ratios import Ratio, report

MODULES = (engine, grammar, trainer, delta_io, round, estimators, logprob_memory, record_bytes, vocab_scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=".bench/ratios.json", help="where the table is written as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that every benchmark runs")
    args = parser.parse_args()
    ratios: list[Ratio] = []
    for module in MODULES:
        t0 = time.perf_counter()
        options = module.arguments().parse_args(module.SMOKE if args.smoke else [])
        got = module.measure(options)
        ratios += got
        print(f"{module.__name__}: {len(got)} ratio(s) in {time.perf_counter() - t0:.0f} s", flush=True)
    report(ratios, args.json)


if __name__ == "__main__":
    main()
