"""`make demo`: build the base model, then run rounds through a real Dagster instance.

Each run is submitted to the instance ($DAGSTER_HOME, default .prodrl/dagster_home) as the UI's
Launch button submits it, queued, and launched by the Dagster daemon, which the demo runs for its
duration; its progress is read back from the run's event log. `make ui` shows the same runs
afterwards. Running it again continues the same long run with the next rounds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from contextlib import suppress
from pathlib import Path

from dagster import AssetKey, DagsterInstance, DagsterRunStatus
from dagster._core.scheduler.instigation import InstigatorStatus

from assets.eval_report import SUMMARY_COLUMNS
from assets.launch import cancel, daemon, follow, in_flight, submit, workspace
from assets.partitions import round_key, round_number
from prodrl_pipeline.evals.report import gain_over_base, markdown_table
from prodrl_pipeline.records.queries import round_summary
from resources.settings import resources_from_environment

WORKSPACE = "workspace.yaml"
GAIN = "gain (95% CI)"


def main() -> int:
    """0 once the rounds ran and their table is printed; a failure exits 1 with its reason."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds to run (default 3)")
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGHUP):  # a kill or a closed terminal stops as Ctrl-C does
        signal.signal(signum, lambda n, _: sys.exit(128 + n))
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path(".prodrl/dagster_home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with DagsterInstance.get() as instance:
        refuse_if_busy(instance)
        with daemon(WORKSPACE, home / "daemon.log") as proc, workspace(instance, WORKSPACE) as context:
            print(f"prodrl demo: runs go to DAGSTER_HOME={home}; the daemon's log is {home / 'daemon.log'}")

            def run(job: str, label: str, tags: dict[str, str] | None = None) -> None:
                t = time.perf_counter()
                print(f"== {label}: {job} submitted", flush=True)
                run_id = submit(instance, context, job, tags)
                show = lambda line: print(f"[{label}] {line}", flush=True)  # noqa: E731
                try:
                    last = follow(instance, run_id, show, lambda: proc.poll() is None)
                except (KeyboardInterrupt, SystemExit):
                    show(f"interrupted: canceling run {run_id[:8]} (the next demo runs its round again)")
                    with suppress(Exception):  # best effort: the daemon is stopped next either way
                        cancel(instance, run_id)
                    raise
                if instance.get_run_by_id(last).status != DagsterRunStatus.SUCCESS:
                    raise SystemExit(f"{label} failed: run {last} (`make ui`, Runs, shows its logs)")
                print(f"== {label} took {time.perf_counter() - t:.1f} s", flush=True)

            run("base_job", "base model")
            first = first_round(instance)
            for k in range(first, first + args.rounds):
                key = round_key(k)
                instance.add_dynamic_partitions("rounds", [key])
                run("round_job", f"round {k}", {"dagster/partition": key})
    resources = resources_from_environment()  # what the definitions use
    store, experiment = resources["store"], resources["lab"].experiment
    summary = round_summary(store.tables(), experiment)
    print(f"\nprodrl demo: {args.rounds} rounds in {time.perf_counter() - t0:.1f} s\n")
    # each round's gain over the base, paired on the puzzles both were evaluated on
    gains = {r["round"]: gain_over_base(store.tables(), experiment, r["round"]) for r in summary[1:]}
    for row in summary:
        gain = gains.get(row["round"])
        row[GAIN] = gain and "{:+.3f} ({:+.3f}, {:+.3f})".format(gain.diff, *gain.interval(0.95))
    print(markdown_table(summary, [*SUMMARY_COLUMNS, GAIN]))
    last = summary[-1]["round"]
    gain = gains[last]
    lo, hi = gain.interval(0.95)
    print(
        f"\nheld-out greedy solve rate: base {gain.baseline_rate:.3f} -> round {last} {gain.rate:.3f}, "
        f"gain {gain.diff:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}, {gain.n} paired puzzles)"
    )
    return 0


def refuse_if_busy(instance: DagsterInstance) -> None:
    """The demo drives the instance alone: no run of it in flight, and no round sensor starting
    rounds beside it (the sensor would also add the next round)."""
    busy = in_flight(instance)
    if busy:
        names = ", ".join(
            f"{r.run_id[:8]} ({r.job_name} {r.tags.get('dagster/partition', '')}, {r.status.value.lower()})"
            for r in busy
        )
        raise SystemExit(
            f"runs of this instance are still queued or running: {names}. Wait for them, or terminate "
            "them (make ui: Runs, the run, Terminate), then run the demo again"
        )
    sensors = {s.name: s.status for s in instance.all_instigator_state()}
    if sensors.get("round_sensor") == InstigatorStatus.RUNNING:
        raise SystemExit(
            "round_sensor is on: it starts rounds by itself; turn it off (make ui: Automation) first"
        )


def first_round(instance: DagsterInstance) -> int:
    """The first round with no report yet (an interrupted round runs again), else the next one."""
    added = sorted(round_number(k) for k in instance.get_dynamic_partitions("rounds"))
    reported = {round_number(k) for k in instance.get_materialized_partitions(AssetKey("eval_report"))}
    return next((k for k in added if k not in reported), max(added, default=0) + 1)


if __name__ == "__main__":
    sys.exit(main())
