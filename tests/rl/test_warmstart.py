import copy
import math

import pytest
import torch

from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.tool_choice import tool_choice_constraint
from prodrl_pipeline.rl.warmstart import COPY_LENGTH, WarmStartConfig, copy_pretrain, solved_turns, warm_start


def test_turns_are_what_the_constrained_engine_emits(tokenizer, train_puzzles):
    puzzles = train_puzzles[:3] + [p for p in train_puzzles if "mateIn2" in p.themes][:2]
    turns = solved_turns(tokenizer, puzzles)
    assert len(turns) == sum(p.n_player_moves for p in puzzles)
    first = turns[0]
    episode = ChessEpisode(puzzles[0])
    state = tool_choice_constraint(tokenizer, "move", "move", episode.allowed_moves()).start()
    for tok, support in zip(first.completion_ids, first.supports, strict=True):
        assert support == state.allowed() and tok in support  # every token is one the engine may emit
        state.advance(tok)
    assert state.finished  # the completion ends where the constraint does
    free = [s for s in first.supports if len(s) > 1]
    assert free and len(free[0]) == len(episode.allowed_moves())  # the move: one token per legal move


def test_warm_start_learns_and_is_deterministic(tiny_model, tokenizer, train_puzzles):
    turns = solved_turns(tokenizer, train_puzzles[:12])
    cfg = WarmStartConfig(steps=30, batch_size=8, lr=1e-2, seed=1)
    a, b = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    rows = warm_start(a, turns, cfg, tokenizer.pad_token_id)
    warm_start(b, turns, cfg, tokenizer.pad_token_id)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    # memorizing 12 puzzles: the solution's probability among the legal moves rises from ~1/30
    assert rows[0]["solution_prob"] < 0.1 and rows[-1]["solution_prob"] > 0.5
    assert rows[-1]["loss"] < rows[0]["loss"] / 3


def test_demonstrations_are_a_prefix_of_the_split_and_bad_settings_are_refused(train_puzzles):
    assert WarmStartConfig(puzzles=5).demonstrations(train_puzzles) == train_puzzles[:5]
    assert WarmStartConfig(puzzles=0).demonstrations(train_puzzles) == train_puzzles
    for bad in ({"puzzles": -1}, {"steps": -1}, {"batch_size": 0}, {"lr": 0.0}, {"copy_steps": -1}):
        with pytest.raises(ValueError, match="warm start needs"):
            WarmStartConfig(**bad)
    with pytest.raises(ValueError, match="schedule"):
        WarmStartConfig(schedule="linear")


def test_a_cosine_schedule_decays_the_learning_rate_to_zero(tiny_model, tokenizer, train_puzzles):
    turns = solved_turns(tokenizer, train_puzzles[:4])
    for schedule in ("constant", "cosine"):
        cfg = WarmStartConfig(steps=4, batch_size=2, lr=1e-3, schedule=schedule)
        lrs = [r["lr"] for r in warm_start(copy.deepcopy(tiny_model), turns, cfg, tokenizer.pad_token_id)]
        expected = (
            [1e-3] * 4
            if schedule == "constant"
            else [1e-3, 0.5e-3 * (1 + 2**-0.5), 0.5e-3, 0.5e-3 * (1 - 2**-0.5)]
        )
        assert lrs == pytest.approx(expected)


def test_copy_pretraining_makes_a_model_repeat_sequences_it_never_saw(tiny_model, tokenizer, train_puzzles):
    turns = solved_turns(tokenizer, train_puzzles[:20])
    vocab = torch.tensor(sorted({t for turn in turns for t in turn.completion_ids}))
    losses = copy_pretrain(tiny_model, turns, 200, seed=0)
    assert losses[0] > 0.8 * math.log(len(vocab))  # before: about uniform over the ids
    unseen = vocab[torch.randint(len(vocab), (32, COPY_LENGTH), generator=torch.Generator().manual_seed(99))]
    with torch.no_grad():
        guess = tiny_model(torch.cat([unseen, unseen], dim=1)).logits[:, COPY_LENGTH - 1 : -1].argmax(-1)
    assert (guess == unseen).float().mean() > 0.9  # the second copy predicted from the first
