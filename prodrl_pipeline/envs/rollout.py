"""The lab's traffic: play puzzles against a deployment and record every call (docs/tables.md).

All unfinished episodes take their turn together, one batched engine call per turn, so a batch
of puzzles costs (number of turns) engine calls. Each call is recorded exactly as the engine
consumed and produced it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.engine.constraints import AfterReasoning
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chat import parse_assistant_text
from prodrl_pipeline.envs.chess_env import THINK_CLOSE, ChessEpisode, Mode
from prodrl_pipeline.envs.puzzles import Puzzle
from prodrl_pipeline.envs.tool_choice import tool_choice_constraint
from prodrl_pipeline.records import support

log = logging.getLogger(__name__)


@dataclass
class Rollouts:
    calls: list[dict]
    trajectories: list[dict]


def _trajectory_id(deployment_id: str, round_: int, seed: int, index: int, puzzle_id: str) -> str:
    return hashlib.sha1(f"{deployment_id}/{round_}/{seed}/{index}/{puzzle_id}".encode()).hexdigest()[:16]


def play(
    engine: TorchEngine,
    tokenizer: PreTrainedTokenizerBase,
    puzzles: Sequence[Puzzle],
    params: SamplingParams,
    *,
    deployment_id: str,
    round_: int,
    seed: int,
    mode: Mode = "structured",
    constrain: bool = True,
    partial_credit: bool = False,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> Rollouts:
    """Play each puzzle once in `mode` (chess_env.Mode). With `constrain`, the `move` argument is
    limited to the legal moves (structured outputs; in the free-text mode from the end of the
    reasoning on); otherwise the model writes it and a malformed call or an illegal move ends the
    episode with reward 0 (the call is recorded all the same)."""
    think_close = tokenizer.convert_tokens_to_ids(THINK_CLOSE) if mode == "free_text" else None
    calls, trajectories = [], []
    for start in range(0, len(puzzles), batch_size):
        chunk = puzzles[start : start + batch_size]
        episodes = [ChessEpisode(p, partial_credit=partial_credit, mode=mode) for p in chunk]
        ids = [
            _trajectory_id(deployment_id, round_, seed, start + i, p.puzzle_id) for i, p in enumerate(chunk)
        ]
        started = datetime.now(UTC)
        n_calls = [0] * len(chunk)
        n_tokens = [0] * len(chunk)
        turn = 0
        while active := [i for i, e in enumerate(episodes) if not e.done]:
            requests = []
            for i in active:
                e = episodes[i]
                constraint = (
                    tool_choice_constraint(tokenizer, "move", "move", e.allowed_moves())
                    if constrain
                    else None
                )
                if constraint and think_close is not None:
                    constraint = AfterReasoning(constraint, think_close)
                requests.append(Request(render_ids(tokenizer, e.messages), params, constraint))
            batch_seed = seed * 1_000_003 + start * 101 + turn
            outs = engine.generate(requests, seed=batch_seed)
            now = datetime.now(UTC)
            for i, req, out in zip(active, requests, outs, strict=True):
                text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
                answered = len(episodes[i].messages) + 1  # the conversation up to this call's answer
                episodes[i].step(parse_assistant_text(tokenizer, text), cut_off=out.finish_reason != "stop")
                calls.append(
                    {
                        "call_id": f"{ids[i]}-{n_calls[i]}",
                        "trajectory_id": ids[i],
                        "call_index": n_calls[i],
                        "round": round_,
                        "deployment_id": deployment_id,
                        "prompt_token_ids": req.prompt_ids,
                        "completion_token_ids": out.token_ids,
                        "completion_logprobs": out.logprobs,
                        "topk_token_ids": out.topk_ids,
                        "topk_logprobs": out.topk_logprobs,
                        **support.columns(out.supports),
                        "extra_token_ids": out.extra_ids,
                        "vocab_size": engine.vocab_size,
                        "sampling": params.recorded(batch_seed),
                        "finish_reason": out.finish_reason,
                        "messages_json": json.dumps(episodes[i].messages[:answered]),
                        "created_at": now,
                    }
                )
                n_calls[i] += 1
                n_tokens[i] += len(out.token_ids)
            turn += 1
        finished = datetime.now(UTC)
        for i, e in enumerate(episodes):
            trajectories.append(
                {
                    "trajectory_id": ids[i],
                    "round": round_,
                    "deployment_id": deployment_id,
                    "task_id": e.puzzle.puzzle_id,
                    "reward": e.reward,
                    "n_calls": n_calls[i],
                    "n_completion_tokens": n_tokens[i],
                    "started_at": started,
                    "finished_at": finished,
                    "source": "lab",
                }
            )
        if progress:
            progress(min(start + batch_size, len(puzzles)), len(puzzles))
    return Rollouts(calls, trajectories)
