"""Where a lab round's time goes, and what Dagster adds to it.

A round of the embedded lab (`LabResource` in `--mode`, default structured: S = 16 steps of B = 64
trajectories, the held-out evaluation, NVFP4 export) runs through `dagster.materialize` in process
on a fresh store, after its base model (warm-started, or `--base`, a saved one). Timers wrap,
without changing them, the calls that do a round's work:
- engine: `TorchEngine.generate` (collection and the held-out evaluation);
- trainer: `train_round` (the optimizer steps) and `policy_logprobs` (the round's pi_k pass);
- export: the NVFP4 export of the deployment;
- tables: every `DeltaStore` entry point (reads, queries, opening a table, writes, the live pointer);
- environment: the chess episodes (`ChessEpisode` set-up and `step`) and the move constraints;
- tokenizer: rendering conversations to prompt ids;
- puzzle files, validation (of the collected calls), checkpoint files (with the resumable state),
  plots (eval_report's PNGs):
  the largest pieces of bookkeeping;
- asset bodies: each round asset's own function (everything above happens inside them).
Shares of the round's wall time, one sample per round:
- the tables (every Delta read and write), goal <= 0.02;
- Dagster (the wall time outside the asset bodies), goal <= 0.10. The three asset checks' steps
  count on Dagster's side, so this bounds Dagster's own cost from above;
- the environment, tokenizer and bookkeeping (asset bodies minus engine, trainer and export),
  goal <= 0.15.
Run: `make bench` (or `.venv/bin/python -m bench.round`).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from dagster import instance_for_test, materialize

import assets.advantages
import assets.checkpoint
import assets.deployment
import assets.eval_report
import assets.metadata
import assets.trajectories
import prodrl_pipeline.envs.rollout
import resources.lab
from assets.base_model import base_model
from assets.checks import CHECKS
from assets.partitions import round_key
from bench.ratios import Ratio, report
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.records.store import DeltaStore
from resources.lab import LabResource
from resources.store import StoreResource

ROUND = [
    assets.trajectories.trajectories,
    assets.advantages.advantages,
    assets.checkpoint.checkpoint,
    assets.deployment.deployment,
    assets.eval_report.eval_report,
]
ASSETS = [base_model, *ROUND, *CHECKS]
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
BODIES = [
    (assets.trajectories, "_trajectories_round"),
    (assets.advantages, "_advantages_round"),
    (assets.checkpoint, "_checkpoint_round"),
    (assets.deployment, "_deployment_round"),
    (assets.eval_report, "_eval_report_round"),
]
WORK = {  # bucket: (owner, attribute) pairs, looked up at call time by their callers
    "engine": [(TorchEngine, "generate")],
    "trainer": [(assets.checkpoint, "train_round"), (assets.checkpoint, "policy_logprobs")],
    "export": [(assets.deployment, "export_deployment")],
    "tables": [  # every public entry point of the store (outermost calls only: no double counting)
        (DeltaStore, name)
        for name in (
            "read",
            "query",
            "table",
            "exists",
            "overwrite",
            "overwrite_round",
            "append",
            "transaction_version",
            "update",
            "update_if",
        )
    ],
    "environment": [
        (ChessEpisode, "__post_init__"),
        (ChessEpisode, "step"),
        (prodrl_pipeline.envs.rollout, "tool_choice_constraint"),
    ],
    "tokenizer": [(prodrl_pipeline.envs.rollout, "render_ids")],
    "puzzle files": [(resources.lab, "_puzzles")],
    "validation": [(assets.trajectories, "split_valid"), (assets.trajectories, "prefix_continuity")],
    "checkpoint files": [
        (assets.checkpoint, "save_checkpoint"),
        (assets.checkpoint, "load_checkpoint"),
        (assets.checkpoint, "save_state"),
        (assets.deployment, "load_checkpoint"),
    ],
    "plots": [(assets.metadata, "curves_png")],
}
MODEL_WORK = ("engine", "trainer", "export")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1, help="rounds timed, one sample each")
    parser.add_argument("--steps", type=int, default=16, help="S")
    parser.add_argument("--batch", type=int, default=64, help="B")
    parser.add_argument("--eval-puzzles", type=int, default=0, help="held-out puzzles (0 = all)")
    parser.add_argument(
        "--warm-start-steps", type=int, help="the base model's (not timed; default: the mode's)"
    )
    parser.add_argument(
        "--mode", choices=["structured", "free_text"], default="structured", help="the lab's mode"
    )
    parser.add_argument("--base", help="a saved base checkpoint to start from (no warm start)")
    return parser


SMOKE = ["--steps", "1", "--batch", "4", "--eval-puzzles", "4", "--warm-start-steps", "0"]


@contextmanager
def timers() -> Iterator[dict[str, float]]:
    """Seconds spent in each bucket's calls (outermost calls only: no double counting)."""
    spent: dict[str, float] = defaultdict(float)
    depth: dict[str, int] = defaultdict(int)

    def timed(bucket: str, fn):  # noqa: ANN001, ANN202
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            depth[bucket] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[bucket] -= 1
                if not depth[bucket]:
                    spent[bucket] += time.perf_counter() - t0

        return wrapper

    with ExitStack() as restore:
        for bucket, targets in [*WORK.items(), ("asset bodies", BODIES)]:
            for owner, name in targets:
                original = getattr(owner, name)
                setattr(owner, name, timed(bucket, original))
                restore.callback(setattr, owner, name, original)
        yield spent


def measure(args: argparse.Namespace) -> list[Ratio]:
    shares, tables, dagster, lines = [], [], [], []
    if args.base and args.warm_start_steps is not None:
        raise SystemExit("--base starts from a saved model: --warm-start-steps does not apply")
    with tempfile.TemporaryDirectory() as root, instance_for_test() as instance:
        lab = LabResource(
            mode=args.mode,
            steps=args.steps,
            batch_size=args.batch,
            eval_puzzles=args.eval_puzzles,
            warm_start_steps=args.warm_start_steps,
            base_checkpoint=args.base or "",
        )
        if args.base and len(lab.tokenizer()) != len(LabResource(mode=args.mode).tokenizer()):
            raise SystemExit(f"{args.base} has another vocabulary than --mode {args.mode}'s tokenizer")
        resources = {"store": StoreResource(root=root), "lab": lab}
        assert materialize([base_model], instance=instance, resources=resources, run_config=QUIET).success
        for k in range(1, args.rounds + 1):
            instance.add_dynamic_partitions("rounds", [round_key(k)])
            with timers() as spent:
                t0 = time.perf_counter()
                assert materialize(
                    ASSETS,
                    selection=ROUND,
                    partition_key=round_key(k),
                    instance=instance,
                    resources=resources,
                ).success
                wall = time.perf_counter() - t0
            rest = spent["asset bodies"] - sum(spent[name] for name in MODEL_WORK)
            shares.append(rest / wall)
            tables.append(spent["tables"] / wall)
            dagster.append((wall - spent["asset bodies"]) / wall)
            other = rest - sum(spent[name] for name in WORK if name not in MODEL_WORK)
            parts = ", ".join(f"{name} {spent[name]:.1f} s" for name in [*WORK, "asset bodies"])
            parts += f", other bookkeeping {other:.1f} s"
            lines.append(f"round {k}: {wall:.1f} s ({parts})")
    base = f", base {args.base}" if args.base else ""
    setting = f"{args.mode}{base}, S={args.steps}, B={args.batch}, {args.rounds} round(s); "
    setting += "; ".join(lines)
    return [
        Ratio("Delta I/O / lab round", tuple(tables), 0.02, at_least=False, detail=setting),
        Ratio("Dagster / lab round", tuple(dagster), 0.10, at_least=False),
        Ratio("environment + tokenizer + bookkeeping / lab round", tuple(shares), 0.15, at_least=False),
    ]


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
