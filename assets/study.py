"""`make study`: the lab study's configurations x seeds through the real round graph, and its report.

    python -m assets.study run [--configs sc16,tis_ppo] [--seeds 0,1,2] [--rounds 3]
    python -m assets.study report [--out docs/results.md]

Every (configuration, seed) is an experiment on the Dagster instance ($DAGSTER_HOME), its tables in
`<root>/<store>/s<seed>` (a replay shares its traffic source's store). A re-run skips every round
already trained and evaluated, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dagster import DagsterInstance, materialize
from transformers.utils import logging as hf_logging

from assets.base_model import base_model
from assets.definitions import ASSETS, ROUND_ASSETS
from assets.partitions import round_key
from prodrl_pipeline.evals.gate import paired_difference
from prodrl_pipeline.evals.report import curves_png, gain_over_base, markdown_table
from prodrl_pipeline.evals.study import (
    COMPARISONS,
    CONFIGS,
    STUDY_DEFAULTS,
    StudyConfig,
    run_order,
    seed_difference,
    store_name,
    verdict,
)
from prodrl_pipeline.records.queries import round_summary, stored_results
from prodrl_pipeline.records.registry import BASE, round_id
from prodrl_pipeline.records.store import DeltaStore
from resources.lab import EstimatorSettings, LabResource
from resources.store import StoreResource

DEFAULT_ROOT = Path(".prodrl/study")
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # progress lines stay readable;
# every run's full log is in the Dagster instance (`make ui`)


def _lab(c: StudyConfig, seed: int, base_dir: Path, defaults: Mapping[str, object]) -> LabResource:
    settings = {
        **STUDY_DEFAULTS,
        **defaults,
        **c.settings,
        "experiment": c.name,
        "seed": seed,
        "base_checkpoint": str(base_dir),
        "counterfactual": c.replay_of is not None,
        "compare_to": c.replay_of or "main",
    }
    estimator = EstimatorSettings(**settings.pop("estimator", {}))
    return LabResource(**settings, estimator=estimator)


def _store(root: Path, c: StudyConfig, seed: int) -> StoreResource:
    return StoreResource(root=str(root / store_name(c) / f"s{seed}"))


def finished(tables: DeltaStore, experiment: str, k: int) -> bool:
    """Round k of `experiment` is trained and its deployment evaluated."""
    ids = set(tables.read("checkpoints").column("checkpoint_id").to_pylist())
    return round_id(experiment, k) in ids and bool(stored_results(tables, round_id(experiment, k)))


def study_base(instance: DagsterInstance, root: Path, defaults: Mapping[str, object]) -> Path:
    """The one base model every configuration starts from (built once, with its tokenizer)."""
    out = root / "base_model"
    settings = json.dumps(dict(defaults), sort_keys=True)
    if (out / "model.safetensors").exists():
        if (out / "study_defaults.json").read_text() != settings:
            raise SystemExit(f"{out} was built with other settings; use another --root or remove {root}")
        return out
    lab = LabResource(**defaults)
    store = StoreResource(root=str(root / "base"))
    assert materialize(
        [base_model], instance=instance, resources={"store": store, "lab": lab}, run_config=QUIET
    ).success
    tmp = root / "base_model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(store.path("checkpoints", BASE), tmp)
    lab.tokenizer().save_pretrained(tmp)
    (tmp / "study_defaults.json").write_text(settings)
    tmp.rename(out)
    return out


def run_study(
    instance: DagsterInstance,
    root: Path,
    names: Sequence[str],
    seeds: Sequence[int],
    rounds: int,
    defaults: Mapping[str, object] | None = None,
    log=print,  # noqa: ANN001
) -> int:
    """Run every round not yet finished; returns how many rounds ran."""
    defaults = dict(defaults or {})
    configs = run_order(names)
    base_dir = study_base(instance, root, defaults)
    instance.add_dynamic_partitions("rounds", [round_key(k) for k in range(1, rounds + 1)])
    todo = [(s, c, k) for s in seeds for c in configs for k in range(1, rounds + 1)]
    ran, t0 = 0, time.perf_counter()
    for i, (seed, c, k) in enumerate(todo, 1):
        store = _store(root, c, seed)
        tables = store.tables()
        if finished(tables, c.name, k):
            continue
        resources = {"store": store, "lab": _lab(c, seed, base_dir, defaults)}
        if not stored_results(tables, BASE):
            assert materialize([base_model], instance=instance, resources=resources, run_config=QUIET).success
        t = time.perf_counter()
        result = materialize(
            ASSETS,
            selection=ROUND_ASSETS,
            partition_key=round_key(k),
            instance=instance,
            resources=resources,
            run_config=QUIET,
            raise_on_error=False,
        )
        if not result.success:
            raise SystemExit(f"{c.name} seed {seed} round {k} failed; re-run to resume")
        ran += 1
        rate = statistics.fmean(r["solved"] for r in stored_results(tables, round_id(c.name, k)))
        left = len(todo) - i
        eta = (time.perf_counter() - t0) / ran * left
        log(
            f"[{i}/{len(todo)}] {c.name} seed {seed} round {k}: held-out {rate:.3f} "
            f"({time.perf_counter() - t:.0f} s; ~{eta / 60:.0f} min left)"
        )
    return ran


def _results(root: Path, c: StudyConfig, seed: int, k: int) -> dict[str, bool]:
    rows = stored_results(_store(root, c, seed).tables(), round_id(c.name, k))
    return {r["puzzle_id"]: r["solved"] for r in rows}


def _staleness_per_step(root: Path, name: str, seeds: Sequence[int]) -> list[float]:
    """Mean over seeds of each optimizer step's staleness: the sawtooth (0 at each round start)."""
    c = next(c for c in CONFIGS if c.name == name)
    runs = []
    for s in seeds:
        rows = [
            r for r in _store(root, c, s).tables().read("train_steps").to_pylist() if r["experiment"] == name
        ]
        runs.append([r["staleness"] for r in sorted(rows, key=lambda r: r["step"])])
    width = min((len(r) for r in runs), default=0)
    return [statistics.fmean(r[i] for r in runs) for i in range(width)]


def write_report(root: Path, out: Path, seeds: Sequence[int]) -> str:
    """docs/results.md and its PNGs from the stored tables of every finished configuration."""
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = out.parent / "results"
    figures.mkdir(exist_ok=True)
    for stale in figures.glob("*.png"):  # figures of a comparison no longer drawn must not linger
        stale.unlink()
    curves: dict[str, dict[int, list[dict]]] = {}
    for c in CONFIGS:
        per_seed = {s: round_summary(_store(root, c, s).tables(), c.name) for s in seeds}
        curves[c.name] = {s: rows for s, rows in per_seed.items() if len(rows) > 1}
    lines = [
        "# Lab study results",
        "",
        f"Generated by `python -m assets.study report` from the tables under `{root}`; seeds {list(seeds)}.",
        *(
            [f"**Preliminary: {len(seeds)} of the study's 3 seeds.** Intervals carry no seed variance.", ""]
            if len(seeds) < 3
            else []
        ),
        "Held-out greedy solve rate on all held-out puzzles; differences are final round A − B, seed by",
        "seed on the same puzzles, with a 95% interval (Student's t over seeds; one seed: paired puzzles).",
        'A verdict needs the interval clear of 0 ("does not hurt": clear of -2 points); the variance',
        "claim compares standard deviations over seeds and is only indicative with 3 seeds.",
        "",
        "## Scale",
        "",
        "The recipe's findings come from a 35B model trained on GPUs for many rounds. Here every",
        "configuration runs the lab's defaults (docs/lab.md): the 1.2M-parameter warm-started model,",
        "3 rounds of 16 optimizer steps x 64 trajectories (1 step for `sc1`/`retok1`), NVFP4",
        "deployments, all 1,268 held-out puzzles; the deploy gate is open so that every round deploys.",
        "A 16 x 64 round takes ~65 s (a replay ~50 s, a 1-step round ~20 s); one seed of all 14",
        "configurations took 49 minutes on 2 cores shared with other work, so 3 seeds take ~2.5 hours.",
        "Effects smaller than ~2 points are below what one seed can resolve.",
        "",
        "| configuration | settings | traffic |",
        "|---|---|---|",
        *(
            f"| {c.name} | {json.dumps(dict(c.settings))} | "
            f"{'replay of ' + c.replay_of if c.replay_of else 'own'} |"
            for c in CONFIGS
        ),
        "",
        "## Findings",
        "",
        "| finding | A | B | round | A | B | A − B (95% CI) | seeds | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cmp in COMPARISONS:
        a, b = (next(c for c in CONFIGS if c.name == n) for n in (cmp.a, cmp.b))
        diffs, ses, finals = [], [], {cmp.a: [], cmp.b: []}
        # every seed at the same round: the last one both configurations finished in all seeds
        last = {n: {s: rows[-1]["round"] for s, rows in curves[n].items()} for n in (cmp.a, cmp.b)}
        k = min((min(last[n].get(s, 0) for n in last) for s in seeds), default=0)
        for s in seeds if k > 0 else ():
            d = paired_difference(_results(root, a, s, k), _results(root, b, s, k))
            diffs.append(d.diff)
            ses.append(d.se)
            finals[cmp.a].append(d.rate)
            finals[cmp.b].append(d.baseline_rate)
        if not diffs:
            lines.append(f"| {cmp.claim} | {cmp.a} | {cmp.b} | - | - | - | - | 0 | not run |")
            continue
        diff = seed_difference(diffs, ses[0] if len(diffs) == 1 else None)
        fa, fb = statistics.fmean(finals[cmp.a]), statistics.fmean(finals[cmp.b])
        if cmp.kind == "less_variance":
            spread = (
                (statistics.stdev(finals[cmp.a]), statistics.stdev(finals[cmp.b])) if len(diffs) > 2 else None
            )
            shown = f"sd over seeds {spread[0]:.3f} vs {spread[1]:.3f}" if spread else "needs 3 seeds"
        else:
            spread, shown = None, f"{diff.mean:+.3f} ({diff.low:+.3f} to {diff.high:+.3f})"
        lines.append(
            f"| {cmp.claim} | {cmp.a} | {cmp.b} | {k} | {fa:.3f} | {fb:.3f} | {shown} | {diff.seeds} | "
            f"{verdict(cmp.kind, diff, spread)} |"
        )
    lines += ["", "## Curves", ""]
    groups = {"a": "recorded vs retokenized", "b": "estimators", "c": "truncated sampling", "d": "asynchrony"}
    groups |= {"e": "KL penalty", "f": "QAT"}
    for prefix, title in groups.items():
        names = list(dict.fromkeys(n for cmp in COMPARISONS if cmp.key[0] == prefix for n in (cmp.a, cmp.b)))
        names = [n for n in names if curves.get(n)]
        if len(names) < 2:
            continue
        for metric, label in (
            ("heldout_solve_rate", "held-out solve rate"),
            ("engine_mismatch", "engine mismatch"),
        ):
            first = 0 if metric == "heldout_solve_rate" else 1  # round 0 (the base) did not train
            width = min(len(r) for n in names for r in curves[n].values())  # rounds all runs finished
            x = list(range(first, width))
            series, bands = {}, {}
            for n in names:
                values = [[r[i][metric] for r in curves[n].values()] for i in x]
                if values and all(v is not None for vs in values for v in vs):
                    series[n] = [statistics.fmean(vs) for vs in values]
                    bands[n] = ([min(vs) for vs in values], [max(vs) for vs in values])
            if not series:
                continue
            png = figures / f"{prefix}_{metric}.png"
            chart = curves_png(
                x, series, "round", f"{title}: {label} (mean; band: min-max over seeds)", bands
            )
            png.write_bytes(chart)
            lines += [f"![{title}: {label}]({figures.name}/{png.name})", ""]
        staleness = {n: _staleness_per_step(root, n, seeds) for n in names}
        steps = max(len(v) for v in staleness.values())
        if steps:
            png = figures / f"{prefix}_staleness.png"
            series = {n: v + [math.nan] * (steps - len(v)) for n, v in staleness.items()}
            title_s = f"{title}: staleness |log pi - log pi_k| (seed mean)"
            png.write_bytes(curves_png(range(1, steps + 1), series, "optimizer step", title_s))
            lines += [f"![{title}: staleness]({figures.name}/{png.name})", ""]
    rows = []
    for n, per_seed in curves.items():
        c = next(c for c in CONFIGS if c.name == n)
        for s, r in per_seed.items():
            gain = gain_over_base(_store(root, c, s).tables(), n, r[-1]["round"])
            low, high = gain.interval()
            rows.append(
                {
                    "config": n,
                    "seed": s,
                    **r[-1],
                    "gain over base (95% CI)": f"{gain.diff:+.3f} ({low:+.3f} to {high:+.3f})",
                }
            )
    lines += [
        "## Final round per run",
        "",
        "Gain over base: paired on the held-out puzzles against the shared base deployment.",
        "",
        markdown_table(
            rows,
            [
                "config",
                "seed",
                "round",
                "heldout_solve_rate",
                "gain over base (95% CI)",
                "mate_in_1",
                "mate_in_2",
                "engine_mismatch",
                "staleness",
            ],
        ),
    ]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.command == "report":
        write_report(args.root, args.out, seeds)
        print(f"wrote {args.out}")
        return
    os.environ.setdefault("DAGSTER_HOME", str(Path(".prodrl/dagster_home").resolve()))
    hf_logging.disable_progress_bar()
    ran = run_study(DagsterInstance.get(), args.root, args.configs.split(","), seeds, args.rounds)
    print(f"study: {ran} rounds ran; `python -m assets.study report` writes {args.out}")


if __name__ == "__main__":
    main()
