"""A lab mode's base and its traffic, measured (docs/lab.md): the base model through the
`base_model` asset (warm start, deployment, held-out evaluation), what its greedy held-out calls
hold, then round 1's collection (`trajectories`) and training (`advantages`, `checkpoint`) through
the round graph on a fresh store, each timed, and what the round's recorded calls (temperature 1)
hold (envs/spellings.py), and how its multi-turn trajectories retokenize (rl/retokenize_causes.py).

    python -m assets.lab_traffic --mode free_text
"""

from __future__ import annotations

import argparse
import tempfile
import time

from dagster import instance_for_test, materialize

from assets.advantages import advantages
from assets.base_model import base_model
from assets.checkpoint import checkpoint
from assets.partitions import round_key
from assets.trajectories import trajectories
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.envs.spellings import traffic_stats
from prodrl_pipeline.records.registry import BASE, lookup
from prodrl_pipeline.rl.retokenize_causes import round_causes
from resources.lab import LabResource
from resources.store import StoreResource

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def measure(lab: LabResource) -> dict[str, float]:
    """The base's held-out figures and its greedy held-out calls' `traffic_stats`, round 1's times
    (seconds) and its traffic's `traffic_stats`."""
    with tempfile.TemporaryDirectory() as root, instance_for_test() as instance:
        resources = {"store": StoreResource(root=root), "lab": lab}
        t0 = time.perf_counter()
        base = materialize([base_model], instance=instance, resources=resources, run_config=QUIET)
        base_seconds = time.perf_counter() - t0
        meta = base.asset_materializations_for_node("base_model")[0].metadata
        out = {
            "base_seconds": base_seconds,
            **{k: v.value for k, v in meta.items() if k.startswith("heldout")},
        }
        store = StoreResource(root=root)
        deployed = lookup(store.tables(), "deployments", "deployment_id", BASE)
        greedy = play(
            lab.engine(store.artifacts().local(deployed["path"]), deployed["quant_format"]),
            lab.tokenizer(),
            lab.puzzles("heldout")[: lab.eval_puzzles or None],
            SamplingParams(temperature=0.0, max_tokens=lab.max_tokens),
            deployment_id=BASE,
            round_=0,
            seed=lab.seed,
            mode=lab.mode,
            constrain=lab.mode == "structured" or lab.constrain_moves,  # as the evaluation plays
        ).calls
        greedy_stats = traffic_stats(lab.tokenizer(), greedy)
        del greedy_stats["sampled_tokens_median"]  # greedy records one-id supports: nothing is sampled
        out.update({f"heldout_greedy_{k}": v for k, v in greedy_stats.items()})
        instance.add_dynamic_partitions("rounds", [round_key(1)])
        graph = [base_model, trajectories, advantages, checkpoint]
        for name, selection in (("collect", [trajectories]), ("train", [advantages, checkpoint])):
            t0 = time.perf_counter()
            done = materialize(
                graph,
                selection=selection,
                partition_key=round_key(1),
                instance=instance,
                resources=resources,
                run_config=QUIET,
            )
            assert done.success, f"round 1's {name} failed"
            out[f"{name}_seconds"] = time.perf_counter() - t0
        calls = store.tables().read("calls", 1).to_pylist()
        out |= {f"round1_{k}": v for k, v in traffic_stats(lab.tokenizer(), calls).items()}
        return out | {f"round1_{k}": v for k, v in retokenized(lab.tokenizer(), calls).items()}


def retokenized(tokenizer, calls: list[dict]) -> dict[str, float]:  # noqa: ANN001
    """Of the multi-turn trajectories among `calls`: how many, how many the template cannot render,
    and of the rendered ones the share whose whole conversation rendered once gives other ids than
    were served: at all, other than in whitespace (every rendering adds a newline after its final
    end-of-turn token), and per cause (rl/retokenize_causes.py)."""
    _, totals = round_causes(calls, tokenizer)
    multi, unrendered = totals.get("multi-turn", 0), totals.get("multi-turn not rendered", 0)
    rendered = multi - unrendered
    share = lambda n: n / rendered if rendered else float("nan")  # noqa: E731
    causes = {k.removeprefix("multi-turn: "): v for k, v in totals.items() if k.startswith("multi-turn: ")}
    return {
        "multi_turn_trajectories": multi,
        "multi_turn_not_rendered": unrendered,
        "multi_turn_retokenized_differ": share(totals.get("multi-turn differ", 0)),
        "multi_turn_differ_not_only_in_whitespace": share(
            totals.get("multi-turn differ not only in whitespace", 0)
        ),
        **{f"multi_turn_differ_by {c}": share(n) for c, n in sorted(causes.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["structured", "free_text"], default="free_text")
    args = parser.parse_args()
    for name, value in measure(LabResource(mode=args.mode)).items():
        print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")


if __name__ == "__main__":
    main()
