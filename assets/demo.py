"""`make demo`: build the base model, then run rounds through a real Dagster instance.

Runs land in $DAGSTER_HOME (default .prodrl/dagster_home), so `make ui` shows them afterwards.
Running it again continues the same long run with the next rounds.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from dagster import DagsterInstance
from transformers.utils import logging as hf_logging

from assets.definitions import defs
from assets.eval_report import SUMMARY_COLUMNS
from assets.partitions import round_key, round_number
from prodrl_pipeline.evals.report import gain_over_base, markdown_table
from prodrl_pipeline.records.queries import round_summary
from resources.settings import resources_from_environment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds to run (default 3)")
    args = parser.parse_args()
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path(".prodrl/dagster_home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    instance = DagsterInstance.get()
    hf_logging.disable_progress_bar()
    run_config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
    t0 = time.perf_counter()
    print(f"== base model (DAGSTER_HOME={home})", flush=True)
    if (
        not defs.resolve_job_def("base_job")
        .execute_in_process(instance=instance, run_config=run_config)
        .success
    ):
        raise SystemExit("base_model failed")
    done = [round_number(k) for k in instance.get_dynamic_partitions("rounds")]
    first = max(done, default=0) + 1
    for k in range(first, first + args.rounds):
        key = round_key(k)
        print(f"== round {k} ({key})", flush=True)
        t = time.perf_counter()
        instance.add_dynamic_partitions("rounds", [key])
        if (
            not defs.resolve_job_def("round_job")
            .execute_in_process(partition_key=key, instance=instance, run_config=run_config)
            .success
        ):
            raise SystemExit(f"round {k} failed")
        print(f"== round {k} took {time.perf_counter() - t:.1f} s", flush=True)
    resources = resources_from_environment()  # what the definitions use
    store, experiment = resources["store"], resources["lab"].experiment
    summary = round_summary(store.tables(), experiment)
    print(f"\nprodrl demo: {args.rounds} rounds in {time.perf_counter() - t0:.1f} s\n")
    print(markdown_table(summary, SUMMARY_COLUMNS))
    last = summary[-1]["round"]
    gain = gain_over_base(store.tables(), experiment, last)
    lo, hi = gain.interval(0.95)
    print(
        f"\nheld-out greedy solve rate: base {gain.baseline_rate:.3f} -> round {last} {gain.rate:.3f}, "
        f"gain {gain.diff:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}, {gain.n} paired puzzles)"
    )


if __name__ == "__main__":
    main()
