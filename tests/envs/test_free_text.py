"""The free-text mode (docs/lab.md): its tokenizer, its template's history rewriting, and its
episodes' handling of what a model writes."""

import json

import chess
import pytest

from prodrl_pipeline.chat.render import load_tokenizer, render_ids
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chat import parse_assistant_text
from prodrl_pipeline.envs.chess_env import (
    ChessEpisode,
    answer_message,
    legal_move_texts,
    move_text,
    parse_move_call,
)
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.envs.spellings import traffic_stats
from prodrl_pipeline.model import build_model
from prodrl_pipeline.records import support
from prodrl_pipeline.records.validate import split_valid
from prodrl_pipeline.rl.warmstart import solved_turns, warm_start
from tests.conftest import build_tiny


@pytest.fixture(scope="module")
def free_tok():
    return load_tokenizer("data/tokenizer_free_text")


def _spellings(tokenizer, text: str, limit: int = 64) -> list[list[int]]:
    """Up to `limit` token sequences that decode to `text`, from the vocabulary's strings."""
    pieces = {}
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id])
        if piece and text.find(piece) >= 0:
            pieces.setdefault(piece, token_id)
    out: list[list[int]] = []

    def walk(rest: str, ids: list[int]) -> None:
        if not rest:
            out.append(ids)
        elif len(out) < limit:
            for piece, token_id in pieces.items():
                if rest.startswith(piece):
                    walk(rest[len(piece) :], [*ids, token_id])

    walk(text, [])
    return out


def test_no_san_move_is_one_token(free_tok, train_puzzles, heldout):
    for puzzle in train_puzzles[:100] + heldout[:100]:
        board = puzzle.start_board()
        for move in legal_move_texts(board):
            for text in (move, f" {move}", json.dumps({"move": move})):
                ids = free_tok.encode(text, add_special_tokens=False)
                assert move not in free_tok.convert_ids_to_tokens(ids), (move, text)


def test_a_non_canonical_spelling_plays_the_same_move(free_tok, train_puzzles):
    """The argument's canonical ids swapped for another spelling of the move: the decoded text
    parses to the same call and the episode plays the same move."""
    tried = 0
    for puzzle in train_puzzles[:20]:
        episode = ChessEpisode(puzzle, mode="free_text")
        move = move_text(episode.board, chess.Move.from_uci(puzzle.moves[1]))
        answer = answer_message(episode.allowed_moves(), move, "free_text")
        prompt = render_ids(free_tok, episode.messages)
        served = render_ids(free_tok, [*episode.messages, answer], add_generation_prompt=False)[len(prompt) :]
        canonical = free_tok.encode(move, add_special_tokens=False)
        at = next(i for i in range(len(served)) if served[i : i + len(canonical)] == canonical)
        others = [s for s in _spellings(free_tok, move) if s != canonical]
        assert len(canonical) >= 2 and others, move
        for spelling in others[:4]:
            ids = served[:at] + spelling + served[at + len(canonical) :]
            message = parse_assistant_text(free_tok, free_tok.decode(ids, skip_special_tokens=False))
            assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"move": move}
            replay = ChessEpisode(puzzle, mode="free_text")
            replay.step(message)
            assert replay.board.move_stack[-1 if replay.done else -2].uci() == puzzle.moves[1]
            tried += 1
    assert tried >= 20


def test_history_drops_earlier_reasoning_and_rerenders_calls_from_their_json(free_tok, train_puzzles):
    puzzle = next(p for p in train_puzzles if "mateIn2" in p.themes)
    episode = ChessEpisode(puzzle, mode="free_text")
    first = answer_message(
        episode.allowed_moves(), move_text(episode.board, chess.Move.from_uci(puzzle.moves[1])), "free_text"
    )
    written = json.dumps(json.loads(first["tool_calls"][0]["function"]["arguments"]), separators=(",", ":"))
    first["tool_calls"][0]["function"]["arguments"] = written  # as a model may space it
    served_prompt = render_ids(free_tok, episode.messages)
    served_text = (
        f'{first["content"]}<tool_call>{{"name": "move", "arguments": {written}}}</tool_call><|im_end|>'
    )
    served = free_tok.encode(served_text, add_special_tokens=False)
    episode.step(first)
    assert not episode.done and episode.messages[-1]["role"] == "user"  # the next position: a user turn
    history = free_tok.decode(render_ids(free_tok, episode.messages), skip_special_tokens=False)
    reasoning = first["content"]
    assert reasoning.startswith("<think>Checks:") and reasoning not in history
    assert json.dumps(json.loads(written)) in history and written not in history
    # the whole trajectory rendered once differs from the served completion
    whole = render_ids(free_tok, episode.messages, add_generation_prompt=False)
    assert whole[: len(served_prompt)] == served_prompt
    assert whole[len(served_prompt) : len(served_prompt) + len(served)] != served
    # the turn being answered keeps its reasoning
    last = answer_message(episode.allowed_moves(), "Kh1", "free_text")
    rendered = free_tok.decode(render_ids(free_tok, [*episode.messages, last]), skip_special_tokens=False)
    turns = rendered.split("<|im_start|>assistant\n")[1:]  # the system prompt mentions the tags too
    assert [t.startswith("<think>") for t in turns] == [False, True, False] and last["content"] in turns[1]


@pytest.mark.parametrize(
    ("text", "cut_off"),
    [
        ("<think>Checks: none</think><|im_end|>", False),  # no call
        (
            '<think>x</think><tool_call>{"name": "move", "arguments": {"move": "Nf3"</tool_call><|im_end|>',
            False,
        ),
        ('<tool_call>{"name": "move", "arguments": {"move": "Ke9"}}</tool_call><|im_end|>', False),  # illegal
        ('<tool_call>{"name": "play", "arguments": {"move": "LEGAL"}}</tool_call><|im_end|>', False),
        ('<tool_call>{"name": "move", "arguments": {"move": "LEGAL"', True),  # cut off by max_tokens
        # cut off after a whole call: the call may not be the whole answer
        ('<tool_call>{"name": "move", "arguments": {"move": "LEGAL"}}</tool_call>', True),
        ('<tool_call>{"name": "move", "arguments": {"move": "LEGAL"}}</tool_call><tool_call>{"na', True),
        ('<tool_call>{"name": "move", "arguments": {"move": "LEGAL"}}</tool_call>Checks: LEGAL LEGAL', True),
    ],
)
def test_a_malformed_illegal_or_cut_off_call_ends_the_episode_with_zero(
    free_tok, train_puzzles, text, cut_off
):
    episode = ChessEpisode(train_puzzles[0], mode="free_text")
    text = text.replace("LEGAL", episode.allowed_moves()[0])  # a legal move, whatever the position
    episode.step(parse_assistant_text(free_tok, text), cut_off=cut_off)
    assert (
        episode.done and episode.reward == 0.0 and "Illegal or malformed" in episode.messages[-1]["content"]
    )


def test_every_free_text_call_is_recorded_and_valid(free_tok, train_puzzles, tmp_path):
    """A random model writes malformed calls: each is recorded, passes the data contract and
    scores 0."""
    model = build_tiny(free_tok)
    engine = TorchEngine(model.eval(), free_tok.eos_token_id, free_tok.pad_token_id, top_logprobs=5)
    params = SamplingParams(max_tokens=24)
    rollouts = play(
        engine,
        free_tok,
        train_puzzles[:6],
        params,
        deployment_id="d",
        round_=1,
        seed=0,
        mode="free_text",
        constrain=False,
    )
    calls, trajectories, rejects = split_valid(rollouts.calls, rollouts.trajectories)
    assert not rejects and len(calls) == len(rollouts.calls) == 6 and len(trajectories) == 6
    assert all(t["reward"] == 0.0 for t in trajectories)
    for call in calls:
        messages = json.loads(call["messages_json"])
        assert messages[-1]["role"] == "assistant" and call["prompt_token_ids"] == render_ids(
            free_tok, messages[:-1]
        )


def test_tool_choice_constrains_the_call_once_the_reasoning_has_ended(free_tok, train_puzzles):
    """constrain=True in the free-text mode: the reasoning is free, the call after `</think>` is
    one of the legal moves' (a bias makes the random model end its reasoning at once)."""
    model = build_tiny(free_tok)
    engine = TorchEngine(model.eval(), free_tok.eos_token_id, free_tok.pad_token_id, top_logprobs=5)
    think_close = free_tok.convert_tokens_to_ids("</think>")
    params = SamplingParams(max_tokens=64, logit_bias=((think_close, 100.0),))
    puzzles = train_puzzles[:6]
    rollouts = play(engine, free_tok, puzzles, params, deployment_id="d", round_=1, seed=0, mode="free_text")
    for call in rollouts.calls:
        text = free_tok.decode(call["completion_token_ids"], skip_special_tokens=False)
        assert text.startswith("</think><tool_call>") and text.endswith("<|im_end|>"), text
        sizes = [s.size for s in support.of_call(call)]
        assert sizes[0] == len(free_tok) and 1 < min(s for s in sizes if s > 1) < len(free_tok)
    legal = {p.puzzle_id: set(ChessEpisode(p).allowed_moves()) for p in puzzles}
    firsts = [c for c in rollouts.calls if c["call_index"] == 0]
    for call, puzzle in zip(firsts, puzzles, strict=True):
        move = parse_move_call(parse_assistant_text(free_tok, free_tok.decode(call["completion_token_ids"])))
        assert move in legal[puzzle.puzzle_id]


def test_warm_start_turns_are_the_templates_rendering_of_the_answer(free_tok, train_puzzles):
    puzzle = next(p for p in train_puzzles if "mateIn2" in p.themes)
    turns = solved_turns(free_tok, [puzzle], "free_text")
    assert len(turns) == 2 and all(s is None for t in turns for s in t.supports)
    text = free_tok.decode(turns[1].completion_ids, skip_special_tokens=False)
    assert text.startswith("<think>Checks: ") and text.endswith("</tool_call><|im_end|>")
    first_answer = free_tok.decode(turns[1].prompt_ids, skip_special_tokens=False).split("assistant\n")[1]
    assert first_answer.startswith("<tool_call>")  # the first turn's reasoning dropped


def test_a_move_spelled_otherwise_is_counted_non_canonical(free_tok, train_puzzles):
    puzzle = train_puzzles[0]
    episode = ChessEpisode(puzzle, mode="free_text")
    move = move_text(episode.board, chess.Move.from_uci(puzzle.moves[1]))
    prompt = render_ids(free_tok, episode.messages)
    answer = answer_message(episode.allowed_moves(), move, "free_text")
    served = render_ids(free_tok, [*episode.messages, answer], add_generation_prompt=False)[len(prompt) :]
    served = served[: served.index(free_tok.eos_token_id) + 1]
    unrestricted = support.columns([support.unrestricted(len(free_tok))] * len(served))
    call = lambda ids: {"completion_token_ids": ids, **unrestricted}  # noqa: E731
    canonical = free_tok.encode(move, add_special_tokens=False)
    at = max(i for i in range(len(served)) if served[i : i + len(canonical)] == canonical)  # the argument
    other = next(s for s in _spellings(free_tok, move) if s != canonical)
    respelled = served[:at] + other + served[at + len(canonical) :]
    assert free_tok.decode(respelled) == free_tok.decode(served)
    stats = traffic_stats(free_tok, [call(served)] * 3 + [call(respelled), call(served[:at])])
    assert stats["parse_rate"] == 4 / 5 and stats["moves"] == 4  # the last one is cut off inside the call
    assert stats["non_canonical_per_1000"] == 250.0
    assert stats["sampled_tokens_median"] == len(served)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="the default warm start is at the line: 94.2-96.1% of sampled calls parse (docs/lab.md#measured)",
)
def test_the_warm_started_free_text_base_writes_well_formed_calls(free_tok, train_puzzles):
    """The free-text mode's default warm start (LabResource): >= 95% of its sampled calls parse."""
    from resources.lab import LabResource

    lab = LabResource(mode="free_text")
    model = build_model(lab.tiny_model(), len(free_tok), free_tok.pad_token_id)
    cfg = lab.warm_start()
    warm_start(
        model,
        solved_turns(free_tok, cfg.demonstrations(lab.puzzles("warmup")), "free_text"),
        cfg,
        free_tok.pad_token_id,
    )
    engine = TorchEngine(model.eval(), free_tok.eos_token_id, free_tok.pad_token_id)
    rollouts = play(
        engine,
        free_tok,
        train_puzzles[:256],
        lab.sampling(),
        deployment_id="d",
        round_=1,
        seed=0,
        mode="free_text",
        constrain=False,
    )
    assert traffic_stats(free_tok, rollouts.calls)["parse_rate"] >= 0.95


def test_a_solved_multi_turn_trajectory_retokenizes_otherwise_for_its_rewritten_history(
    free_tok, train_puzzles
):
    """`python -m assets.lab_traffic`'s retokenization figures on a mate in two played as the
    engine records it: the template drops turn 1's reasoning when the whole conversation is rendered."""
    from assets.lab_traffic import retokenized

    puzzle = next(p for p in train_puzzles if "mateIn2" in p.themes)
    episode, calls = ChessEpisode(puzzle, mode="free_text"), []
    while not episode.done:
        move = move_text(episode.board, chess.Move.from_uci(puzzle.moves[episode.ply]))
        answer = answer_message(episode.allowed_moves(), move, "free_text")
        prompt = render_ids(free_tok, episode.messages)
        full = render_ids(free_tok, [*episode.messages, answer], add_generation_prompt=False)[len(prompt) :]
        completion = full[: full.index(free_tok.eos_token_id) + 1]  # the engine stops at the end token
        served = parse_assistant_text(free_tok, free_tok.decode(completion, skip_special_tokens=False))
        calls.append(
            {
                "call_id": f"t-{len(calls)}",
                "trajectory_id": "t",
                "call_index": len(calls),
                "prompt_token_ids": prompt,
                "completion_token_ids": completion,
                "messages_json": json.dumps([*episode.messages, served]),
            }
        )
        episode.step(served)
    assert len(calls) == 2 and episode.reward == 1.0
    got = retokenized(free_tok, calls)
    assert got["multi_turn_trajectories"] == 1 and got["multi_turn_retokenized_differ"] == 1.0
    assert got["multi_turn_differ_by history rewrite"] == 1.0
    assert "multi_turn_differ_by spelling" not in got  # every id as the tokenizer encodes it
