"""A supervised warm start: the lab's base model learns from solved puzzle transcripts.

Production RL starts from a model that is already decent and peaked; a randomly initialised lab
model solves ~1% and its policy is flat, the regime where engine mismatch and estimator choice
matter least. The warm start trains theta_0 by next-token cross-entropy on the completions of solved
transcripts of the `warmup` split (disjoint by source game and position from the RL training and
held-out splits): each player turn is one example, its prompt rendered exactly as the engine sees
it and its completion exactly the token ids the structured-output constraint lets the engine emit
for the solution move. As served, the policy at a position is pi renormalized over what the
constraint allows there (pi_S, the legal moves), so the loss is -sum_t log pi_S(a_t) over a turn's
free positions (forced wrapper tokens have log pi_S = 0), averaged over turns: the same log pi_S the
RL trainer optimizes. In the free-text mode nothing is constrained: a turn's completion is the
template's rendering of the demonstrated answer (reasoning, then the call; chess_env.answer_message)
and every position is free, with the whole vocabulary as its support. Deterministic for a seed
(one fixed shuffle, seeded initialisation, CPU arithmetic).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import chess
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.envs.chess_env import ChessEpisode, Mode, answer_message, move_text
from prodrl_pipeline.envs.puzzles import Puzzle
from prodrl_pipeline.envs.tool_choice import tool_call_ids, tool_choice_constraint
from prodrl_pipeline.rl.logprobs import Sequences, token_logprobs


@dataclass(frozen=True)
class WarmStartConfig:
    """How the base model is warm-started (steps = 0: keep the random initialisation)."""

    steps: int = 40
    """Adam steps."""
    puzzles: int = 500
    """Demonstrations: the first `puzzles` of the warmup split in file order (0 = all of it)."""
    batch_size: int = 64
    """Player turns per step."""
    lr: float = 2e-3
    """Adam learning rate (betas 0.9, 0.99): the peak, held constant or decayed (`schedule`)."""
    schedule: Literal["constant", "cosine"] = "constant"
    """The learning rate over the steps: constant, or a cosine decay from `lr` to 0 at the last step."""
    copy_steps: int = 0
    """Induction pre-training steps before the warm start (`copy_pretrain`; 0: none)."""
    seed: int = 0
    """Seed of the example shuffle (and of the copy pre-training's sequences)."""

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"warm start schedule must be constant or cosine, got {self.schedule!r}")
        if self.steps < 0 or self.puzzles < 0 or self.batch_size < 1 or self.lr <= 0 or self.copy_steps < 0:
            raise ValueError(
                f"warm start needs steps >= 0, puzzles >= 0, batch_size >= 1, lr > 0, copy_steps >= 0; "
                f"got {self.steps}, {self.puzzles}, {self.batch_size}, {self.lr}, {self.copy_steps}"
            )

    def demonstrations(self, warmup: Sequence[Puzzle]) -> Sequence[Puzzle]:
        """The warmup puzzles the warm start learns from."""
        return warmup[: self.puzzles or None]


@dataclass(frozen=True)
class Turn:
    prompt_ids: list[int]
    completion_ids: list[int]
    supports: list[list[int] | None]  # per completion position: the ids allowed there (None: all)


def solved_turns(
    tokenizer: PreTrainedTokenizerBase, puzzles: Sequence[Puzzle], mode: Mode = "structured"
) -> list[Turn]:
    """Every player turn of every puzzle's solution in `mode`, with the support per position: the
    structured-output constraint's, or the whole vocabulary (free_text)."""
    turns = []
    for puzzle in puzzles:
        episode = ChessEpisode(puzzle, mode=mode)
        while not episode.done:
            move = move_text(episode.board, chess.Move.from_uci(puzzle.moves[episode.ply]))
            answer = answer_message(episode.allowed_moves(), move, mode)
            prompt = render_ids(tokenizer, episode.messages)
            if mode == "free_text":
                completion = _answer_ids(tokenizer, episode.messages, answer, prompt)
                supports: list[list[int] | None] = [None] * len(completion)
            else:
                state = tool_choice_constraint(tokenizer, "move", "move", episode.allowed_moves()).start()
                completion = list(tool_call_ids(tokenizer, "move", "move", move))
                supports = []
                for tok in completion:
                    supports.append(state.allowed())
                    state.advance(tok)
            turns.append(Turn(prompt, completion, supports))
            episode.step(answer)
    return turns


def _answer_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], answer: dict, prompt: list[int]
) -> list[int]:
    """The template's rendering of `answer` after `messages`, up to its end-of-turn token."""
    full = render_ids(tokenizer, [*messages, answer], add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise ValueError("the template's answer turn does not extend its generation prompt")
    completion = full[len(prompt) :]
    return completion[: completion.index(tokenizer.eos_token_id) + 1]


def _sequences(turns: Sequence[Turn], pad_id: int) -> Sequences:
    """The turns' free positions (more than one allowed token) as a trainer batch."""
    width = max(len(t.prompt_ids) + len(t.completion_ids) for t in turns)
    ids = torch.full((len(turns), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(turns), width), dtype=torch.long)
    rows, pos, targets, supports = [], [], [], []
    for n, t in enumerate(turns):
        seq = t.prompt_ids + t.completion_ids
        ids[n, : len(seq)] = torch.tensor(seq)
        mask[n, : len(seq)] = 1
        for i, (tok, support) in enumerate(zip(t.completion_ids, t.supports, strict=True)):
            if support is None or len(support) > 1:
                rows.append(n)
                pos.append(len(t.prompt_ids) + i - 1)
                targets.append(tok)
                supports.append(support)
    n_tok = len(targets)
    target = torch.tensor(targets, dtype=torch.long)
    return Sequences(
        input_ids=ids,
        attention_mask=mask,
        token_row=torch.tensor(rows, dtype=torch.long),
        token_pos=torch.tensor(pos, dtype=torch.long),
        token_ids=target,
        temperature=torch.ones(n_tok),
        support=supports,
        deployment_logprobs=torch.zeros(n_tok),
        head_ids=target[:, None],
        head_mask=torch.ones((n_tok, 1), dtype=torch.bool),
        head_deployment_logprobs=torch.zeros((n_tok, 1)),
        extra_ids=torch.zeros((n_tok, 0), dtype=torch.long),
    )


def _step_loss(
    model: PreTrainedModel, turns: Sequence[Turn], pad_id: int, microbatch: int
) -> tuple[float, float]:
    """Backpropagate -sum log pi_S over free positions, averaged over turns, in microbatches of
    similar length (padding to the longest prompt of the whole batch would double the cost).
    Returns the loss and the mean pi_S of the solution tokens (how peaked the served policy is)."""
    by_length = sorted(turns, key=lambda t: len(t.prompt_ids) + len(t.completion_ids))
    loss, probs = 0.0, []
    for start in range(0, len(by_length), microbatch):
        seqs = _sequences(by_length[start : start + microbatch], pad_id)
        lp = token_logprobs(model, seqs, outputs=frozenset()).logprobs
        part = -lp.sum() / len(turns)
        part.backward()
        loss += part.item()
        probs.append(lp.detach().exp())
    return loss, float(torch.cat(probs).mean())


COPY_LENGTH, COPY_BATCH, COPY_LR = 16, 64, 1e-3


def copy_pretrain(model: PreTrainedModel, turns: Sequence[Turn], steps: int, seed: int) -> list[float]:
    """Induction pre-training: each sequence is COPY_LENGTH ids drawn uniformly from those the
    turns' completions are spelled with, written twice; the loss is the cross-entropy of the second
    copy given the first (COPY_BATCH sequences a step, Adam at COPY_LR). A copy's loss falls to ~0
    once the model has an induction circuit (attend to the earlier occurrence of the current token,
    predict what followed it), which a small model does not form from the demonstrations alone
    (docs/lab.md): it is what copies a move written in the reasoning into the call. Returns the
    loss per step."""
    vocab = torch.tensor(sorted({t for turn in turns for t in turn.completion_ids}))
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=COPY_LR, betas=(0.9, 0.99))
    losses = []
    for _ in range(steps):
        half = vocab[torch.randint(len(vocab), (COPY_BATCH, COPY_LENGTH), generator=gen)]
        logits = model(torch.cat([half, half], dim=1)).logits[:, COPY_LENGTH - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), half.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def warm_start(
    model: PreTrainedModel,
    turns: Sequence[Turn],
    cfg: WarmStartConfig,
    pad_id: int,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train `model` in place (after `cfg.copy_steps` of `copy_pretrain`); one row per step (loss,
    mean pi_S of the solution tokens, learning rate, seconds)."""
    if (cfg.steps or cfg.copy_steps) and not turns:
        raise ValueError("the warm start has no solved turns to learn from")
    if cfg.copy_steps:
        copy_pretrain(model, turns, cfg.copy_steps, cfg.seed)
    order = list(range(len(turns)))
    random.Random(cfg.seed).shuffle(order)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    model.eval()  # no dropout in Qwen3; train mode only slows the CPU attention backward
    rows = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        start = (step * cfg.batch_size) % len(order)
        batch = [turns[order[(start + i) % len(order)]] for i in range(cfg.batch_size)]
        if cfg.schedule == "cosine":  # from lr at step 1 to 0 after the last
            for group in opt.param_groups:
                group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        opt.zero_grad(set_to_none=True)
        loss, solution_prob = _step_loss(model, batch, pad_id, microbatch=16)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        row = {
            "step": step + 1,
            "loss": loss,
            "solution_prob": solution_prob,
            "lr": opt.param_groups[0]["lr"],
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        if progress:
            progress(row)
    return rows
