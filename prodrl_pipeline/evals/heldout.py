"""Held-out evaluation: greedy play of the held-out puzzles against one deployment."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chess_env import Mode
from prodrl_pipeline.envs.puzzles import Puzzle
from prodrl_pipeline.envs.rollout import play


def evaluate(
    engine: TorchEngine,
    tokenizer: PreTrainedTokenizerBase,
    puzzles: Sequence[Puzzle],
    *,
    deployment_id: str,
    round_: int,
    seed: int = 0,
    mode: Mode = "structured",
    constrain: bool = True,
    max_tokens: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """One `eval_results` row per puzzle (greedy decoding: deterministic for fixed weights), played
    in `mode`, with the move constrained as `rollout.play`'s `constrain` says."""
    rollouts = play(
        engine,
        tokenizer,
        puzzles,
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        deployment_id=deployment_id,
        round_=round_,
        seed=seed,
        mode=mode,
        constrain=constrain,
        progress=progress,
    )
    themes = {p.puzzle_id: p.themes for p in puzzles}
    return [
        {
            "round": round_,
            "deployment_id": deployment_id,
            "puzzle_id": t["task_id"],
            "themes": themes[t["task_id"]],
            "reward": t["reward"],
            "solved": t["reward"] >= 1.0,
            "n_calls": t["n_calls"],
        }
        for t in rollouts.trajectories
    ]


def solve_rate(rows: Sequence[dict]) -> float:
    return sum(r["solved"] for r in rows) / len(rows) if rows else float("nan")


def solve_rates_by_theme(rows: Sequence[dict]) -> dict[str, float]:
    """Solve rate per puzzle kind (`mateIn1`, `mateIn2`, ...: the theme starting with `mateIn`)."""
    kinds: dict[str, list[dict]] = {}
    for r in rows:
        kind = next((t for t in r["themes"].split() if t.startswith("mateIn")), "other")
        kinds.setdefault(kind, []).append(r)
    return {kind: solve_rate(group) for kind, group in sorted(kinds.items())}
