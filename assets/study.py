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
import os
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from dagster import DagsterInstance, materialize
from transformers.utils import logging as hf_logging

from assets.base_model import base_model
from assets.definitions import ASSETS, ROUND_ASSETS
from assets.partitions import round_key
from assets.study_report import study_report
from prodrl_pipeline.evals.study import CONFIGS, STUDY_DEFAULTS, StudyConfig, run_order
from prodrl_pipeline.evals.study_report import study_store
from prodrl_pipeline.records.queries import stored_results
from prodrl_pipeline.records.registry import BASE, lookup, round_id
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
    return StoreResource(root=str(study_store(root, c, seed)))


def finished(tables: DeltaStore, lab: LabResource, k: int) -> bool:
    """Round k of `lab.experiment` is trained and its deployment evaluated, with the trainer
    settings `lab` has now (SystemExit if it was trained with others: a resumed study must not
    mix settings)."""
    rows = [
        r for r in tables.read("checkpoints").to_pylist() if r["checkpoint_id"] == round_id(lab.experiment, k)
    ]
    if not rows or not stored_results(tables, round_id(lab.experiment, k)):
        return False
    stored = json.loads((Path(rows[-1]["path"]) / "prodrl.json").read_text())["trainer"]
    now = json.loads(json.dumps(asdict(lab.trainer())))
    if stored != now:
        changed = sorted(key for key in stored.keys() | now.keys() if stored.get(key) != now.get(key))
        raise SystemExit(
            f"{lab.experiment} round {k} was trained with other settings ({', '.join(changed)}); "
            "use another --root, or remove that configuration's store to rerun it"
        )
    return True


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
    base = lookup(store.tables(), "checkpoints", "checkpoint_id", BASE)
    shutil.copytree(store.artifacts().local(base["path"]), tmp)
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
        store, lab = _store(root, c, seed), _lab(c, seed, base_dir, defaults)
        tables = store.tables()
        if finished(tables, lab, k):
            continue
        resources = {"store": store, "lab": lab}
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


def report(instance: DagsterInstance, root: Path, seeds: Sequence[int], out: Path) -> None:
    """Materialize `study_report`: docs/results.md and its PNGs, the same curves in the UI."""
    config = {"root": str(root), "seeds": list(seeds), "out": str(out)}
    run_config = {**QUIET, "ops": {"study_report": {"config": config}}}
    assert materialize([study_report], instance=instance, run_config=run_config).success


def main() -> int:
    """0 once the command is done; a failed round exits 1 with its reason (re-running resumes)."""
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
    os.environ.setdefault("DAGSTER_HOME", str(Path(".prodrl/dagster_home").resolve()))
    if args.command == "report":
        report(DagsterInstance.get(), args.root, seeds, args.out)
        print(f"wrote {args.out}; the same report is the `study_report` asset in the UI")
        return 0
    hf_logging.disable_progress_bar()
    ran = run_study(DagsterInstance.get(), args.root, args.configs.split(","), seeds, args.rounds)
    print(f"study: {ran} rounds ran; `python -m assets.study report` writes {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
