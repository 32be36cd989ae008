"""Round k's traffic: S*B scored trajectories from the live deployment (lab source)."""

import random
from collections import Counter

from dagster import AssetExecutionContext, Config, MaterializeResult, asset

from assets.base_model import base_model
from assets.partitions import round_number, rounds
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.records.validate import split_valid
from resources.lab import LabResource
from resources.store import StoreResource


class TrajectoriesConfig(Config):
    recollect: bool = False
    """Collect again even if the round's trajectories are stored (they are immutable otherwise)."""


@asset(partitions_def=rounds, deps=[base_model], group_name="round", kinds={"delta"})
def trajectories(
    context: AssetExecutionContext, config: TrajectoriesConfig, store: StoreResource, lab: LabResource
) -> MaterializeResult:
    """Collect the round's trajectories from the live deployment, validate them against the data
    contract (violations go to `rejects`) and store calls and trajectories for the round."""
    k = round_number(context.partition_key)
    tables = store.tables(context.run.run_id, context.partition_key)
    stored = tables.read("trajectories", k)
    if stored.num_rows and not config.recollect:
        context.log.info(f"round {k}: {stored.num_rows} stored trajectories are kept (recollect=False)")
        return MaterializeResult(metadata=_summary(stored.to_pylist(), tables, reused=True))
    live = tables.live_deployment()
    if live is None:
        raise RuntimeError("no live deployment: materialize base_model first")
    cfg = lab.trainer()
    n = cfg.steps * cfg.batch_size
    pool = lab.puzzles("train")
    rng = random.Random(lab.seed * 1_000_003 + k)
    puzzles = rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)
    context.log.info(f"round {k}: collecting {n} trajectories from deployment {live['deployment_id']}")
    rollouts = play(
        lab.engine(live["path"]),
        lab.tokenizer(),
        puzzles,
        lab.sampling(),
        deployment_id=live["deployment_id"],
        round_=k,
        seed=lab.seed * 1_000_003 + k,
        constrain=lab.constrain_moves,
        partial_credit=lab.partial_credit,
        progress=lambda done, total: context.log.info(f"round {k}: {done}/{total} trajectories"),
    )
    calls, trajs, rejects = split_valid(rollouts.calls, rollouts.trajectories)
    tables.overwrite_round("calls", calls, k)
    tables.overwrite_round("trajectories", trajs, k)
    tables.overwrite("rejects", rejects, f"round = {k} AND table_name IN ('calls', 'trajectories')")
    return MaterializeResult(
        metadata=_summary(trajs, tables, reused=False, n_calls=len(calls), n_rejects=len(rejects))
    )


def _summary(trajs: list[dict], tables, reused: bool, **extra: int) -> dict:
    rewards = [t["reward"] for t in trajs]
    return {
        "trajectories": len(trajs),
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "deployments": ", ".join(f"{d} ({n})" for d, n in Counter(t["deployment_id"] for t in trajs).items()),
        "completion_tokens": sum(t["n_completion_tokens"] for t in trajs),
        "reused_stored": reused,
        "trajectories_version": tables.table("trajectories").version(),
        "calls_version": tables.table("calls").version(),
        **extra,
    }
