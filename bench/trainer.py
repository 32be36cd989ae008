"""A trainer step against a lean bare step on the same tokens, measured side by side.

B recorded lab trajectories (lab model, K = 20 head) make one minibatch. The trainer step is
`train_round` for one step with the round's pi_k already computed (the default estimator, score
centering over the head: what a lab round runs). The lean step is the least a step must do: from
tensors already packed, forward, project only the sampled completion positions to the vocabulary,
cross-entropy of their ids, backward, Adam: the same microbatches, the same model size. A forced
token (a one-token support: most of a lab call, the tool-call wrapper) has log pi_S = 0 and no
gradient in the trainer's objective, so the trainer projects only the sampled positions, and so
does the lean step of the goal; the lean step projecting every completion position (the baseline
until 2ca003f) is shown beside it. Each repeat times each, in turn, each on its own copy of the model. Ratio:
lean step time ÷ trainer step time (the trainer's speed relative to the lean step), goal >= 0.90.
Also shown: the round's pi_k pass relative to a lean step, and the trainer step with each log-prob
chunk kept for the backward pass instead of recomputed (the price of the log-prob memory goal).
Run: `make bench` (or `.venv/bin/python -m bench.trainer`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import prodrl_pipeline.rl.logprobs
from bench.ratios import Ratio, alternate, report
from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.rl.logprobs import Sequences, build_sequences
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import (
    TrainerConfig,
    _microbatches,
    make_optimizer,
    policy_logprobs,
    train_round,
)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64, help="trajectories in the minibatch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--hidden", type=int, default=128, help="the model's width (the lab's: 128; SwiGLU 3x it)"
    )
    return parser


SMOKE = ["--batch", "4", "--repeats", "1"]


def lean_step(
    model,  # noqa: ANN001
    optimizer: torch.optim.Optimizer,
    micros: list[Sequences],
    picked: list[torch.Tensor],
) -> None:
    """Forward, the `picked` completion positions of each microbatch (bool [Ntok]) through the
    output layer, cross-entropy, backward, Adam."""
    optimizer.zero_grad(set_to_none=True)
    n = sum(int(p.sum()) for p in picked)
    for s, p in zip(micros, picked, strict=True):
        hidden = model.model(input_ids=s.input_ids, attention_mask=s.attention_mask).last_hidden_state
        logits = model.lm_head(hidden[s.token_row[p], s.token_pos[p]])
        (F.cross_entropy(logits, s.token_ids[p], reduction="sum") / n).backward()
    optimizer.step()


@contextmanager
def _chunks_kept() -> Iterator[None]:
    """The trainer's log-prob chunks run without activation checkpointing (kept, not recomputed)."""
    recomputed = prodrl_pipeline.rl.logprobs.checkpoint
    prodrl_pipeline.rl.logprobs.checkpoint = lambda fn, *args, use_reentrant: fn(*args)
    try:
        yield
    finally:
        prodrl_pipeline.rl.logprobs.checkpoint = recomputed


def measure(args: argparse.Namespace) -> list[Ratio]:
    torch.manual_seed(0)
    tok = load_tokenizer("data/tokenizer")
    model = build_model(
        TinyQwen3Config(hidden_size=args.hidden, intermediate_size=3 * args.hidden),
        len(tok),
        tok.pad_token_id,
    )
    puzzles = list(iter_lab_puzzles("data", "train"))[: args.batch]
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id)
    calls = play(engine, tok, puzzles, SamplingParams(), deployment_id="d", round_=1, seed=0).calls
    trajectories = list(dict.fromkeys(c["trajectory_id"] for c in calls))
    advantages = [
        {"trajectory_id": t, "minibatch": 0, "reward": 0.0, "advantage": float(i % 3 - 1)}
        for i, t in enumerate(trajectories)
    ]
    cfg = TrainerConfig(steps=1, batch_size=args.batch, warmup_steps=0)
    trained, lean, every = model, copy.deepcopy(model), copy.deepcopy(model)
    trainer_opt, lean_opt, every_opt = (make_optimizer(m, cfg, None) for m in (trained, lean, every))
    recorded = RecordedCalls.from_rows(calls)  # a round reads its calls once, for all its steps
    micros = [
        build_sequences(recorded.take(mb), tok.pad_token_id)
        for mb in _microbatches(recorded, cfg.microbatch_calls)
    ]
    round_start = policy_logprobs(trained, recorded, cfg, tok.pad_token_id, fake_quant=False)
    sampled = [s.free for s in micros]
    every_position = [torch.ones_like(p) for p in sampled]

    def step() -> None:
        train_round(
            trained, trainer_opt, recorded, advantages, cfg, tok.pad_token_id, round_start=round_start
        )

    def step_chunks_kept() -> None:
        with _chunks_kept():
            step()

    times = alternate(
        {
            "trainer": step,
            "chunks kept": step_chunks_kept,
            "lean": lambda: lean_step(lean, lean_opt, micros, sampled),
            "lean, every position": lambda: lean_step(every, every_opt, micros, every_position),
            "pi_k": lambda: policy_logprobs(trained, recorded, cfg, tok.pad_token_id, fake_quant=False),
        },
        args.repeats,
    )
    n_tokens = sum(len(c["completion_token_ids"]) for c in calls)
    n_sampled = sum(int(p.sum()) for p in sampled)
    lean_s = statistics.median(times["lean"])

    def over_trainer(name: str, trainer: str = "trainer") -> float:
        return statistics.median(l / t for t, l in zip(times[trainer], times[name], strict=True))

    return [
        Ratio(
            "lean step / trainer step (speed, same tokens)",
            tuple(lean_t / t for t, lean_t in zip(times["trainer"], times["lean"], strict=True)),
            0.90,
            detail=(
                f"hidden size {args.hidden}, {len(trajectories)} lab trajectories, {len(calls)} calls, "
                f"{n_tokens} completion tokens of which {n_sampled} sampled, "
                f"{args.repeats} repeats; lean step {lean_s:.2f} s, trainer step "
                f"{statistics.median(times['trainer']):.2f} s, pi_k pass "
                f"{statistics.median(times['pi_k']) / lean_s:.2f} x a lean step; lean step projecting "
                f"every completion position / trainer step: {over_trainer('lean, every position'):.2f}; "
                f"lean step / trainer step with log-prob chunks kept, not recomputed: "
                f"{over_trainer('lean', 'chunks kept'):.2f}"
            ),
        )
    ]


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
