"""Why a trajectory's single re-rendering differs from what was served, on constructed trajectories
with real templates (the lab's, Qwen3's, Gemma 3's); and the command that reports it for a round."""

import json
import subprocess
import sys

import pytest

from prodrl_pipeline.chat.render import plain_ids, render_ids
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.retokenize_causes import (
    cause,
    round_causes,
    round_spellings,
    spellings,
    trajectory_causes,
)
from tests.families import family_tokenizer

SYSTEM = [
    {"role": "system", "content": "Solve the chess puzzle with the move tool."},
    {"role": "user", "content": "White to move. Legal moves: Qh5 Qg4 Kf1"},
]
RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "Black plays g6."}


def move(arguments) -> dict:  # noqa: ANN001 - a JSON string, or the object a client parsed it into
    call = {"id": "call_0", "type": "function", "function": {"name": "move", "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def served(tokenizer, messages: list[dict], trajectory: str = "t") -> list[dict]:
    """One call per assistant turn, served as a deployment serves it: the prompt is the template's
    rendering of the messages before the turn, the completion the template's turn up to and with
    its end-of-turn token (what the engine stops at)."""
    calls = []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, i in enumerate(turns):
        prompt = render_ids(tokenizer, messages[:i])
        turn = render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)[len(prompt) :]
        calls.append(
            {
                "call_id": f"{trajectory}-{k}",
                "trajectory_id": trajectory,
                "call_index": k,
                "round": 1,
                "prompt_token_ids": prompt,
                "completion_token_ids": turn[: turn.index(tokenizer.eos_token_id) + 1],
                "finish_reason": "stop",
                "messages_json": json.dumps(messages[: i + 1]),
            }
        )
    return calls


def resent(tokenizer, call: dict, index: int, message: dict) -> None:
    """`call` as if its client had re-sent history message `index` as `message`."""
    messages = json.loads(call["messages_json"])
    messages[index] = message
    call["messages_json"] = json.dumps(messages)
    call["prompt_token_ids"] = render_ids(tokenizer, messages[:-1])


def in_pieces(tokenizer, call: dict, token: str) -> None:
    """`call`'s completion with `token` sampled as one token per character (the same text)."""
    ids, whole = call["completion_token_ids"], tokenizer.convert_tokens_to_ids(token)
    pieces = tokenizer.convert_tokens_to_ids(list(token))
    assert len(pieces) > 1 and tokenizer.unk_token_id not in pieces and ids.count(whole) == 1
    at = ids.index(whole)
    call["completion_token_ids"] = ids[:at] + pieces + ids[at + 1 :]


def two_moves(tokenizer, first: str = '{"san": "Qh5"}', trajectory: str = "t") -> list[dict]:
    return served(tokenizer, [*SYSTEM, move(first), RESULT, move('{"san": "Qg4"}')], trajectory)


@pytest.fixture(scope="module")
def qwen3():
    return family_tokenizer("qwen3")


def test_qwen3_drops_an_earlier_turns_reasoning_a_history_rewrite(qwen3):
    def conversation(first: str, last: str) -> list[dict]:
        return [
            {"role": "user", "content": "Which move mates?"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And after g6?"},
            {"role": "assistant", "content": last},
        ]

    def bare(answer: str) -> list[int]:
        return qwen3.encode(f"{answer}<|im_end|>", add_special_tokens=False)

    reasoned = conversation(
        "<think>\nQueen check.\n</think>\n\nQh5 mates.", "<think>\nAgain.\n</think>\n\nQg4."
    )
    calls = served(qwen3, reasoned)
    assert "<think>" in qwen3.decode(calls[0]["completion_token_ids"])  # served with its reasoning
    assert "<think>" not in qwen3.decode(calls[1]["prompt_token_ids"])  # the template dropped it
    assert trajectory_causes(calls, qwen3) == ["history rewrite", "whitespace"]
    # no reasoning: the template renders an earlier turn bare, the last one with an empty block
    calls = served(qwen3, conversation("Qh5 mates.", "Qg4."))
    assert trajectory_causes(calls, qwen3) == ["history rewrite", "whitespace"]  # the first's empty block
    calls[0]["completion_token_ids"] = bare("Qh5 mates.")
    assert trajectory_causes(calls, qwen3) == ["whitespace"]
    calls[1]["completion_token_ids"] = bare("Qg4.")
    assert trajectory_causes(calls, qwen3) == ["history rewrite", "whitespace"]


def test_arguments_served_compact_and_rendered_from_their_parse_a_history_rewrite(tokenizer):
    calls = two_moves(tokenizer, first='{"san":"Qh5"}')
    assert trajectory_causes(calls, tokenizer) == ["whitespace"]  # re-sent as served: written as it is
    resent(tokenizer, calls[1], 2, move({"san": "Qh5"}))  # re-sent parsed: `tojson` writes `{"san": "Qh5"}`
    assert '{"san": "Qh5"}' in tokenizer.decode(calls[1]["prompt_token_ids"])
    assert trajectory_causes(calls, tokenizer) == ["history rewrite", "whitespace"]


def test_a_rewritten_turn_is_matched_where_it_ends_not_where_its_text_recurs(qwen3):
    """The call after a rewritten turn resumes after that turn's end-of-turn token, even when the
    next message repeats the dropped reasoning at length (as a position's legal moves repeat the
    checks a reasoning listed)."""
    checks = "Qh5+ Bb5+ Qe2+ Qd1+ Bd3+ Nf6+"
    messages = [
        {"role": "user", "content": "Which move mates?"},
        {"role": "assistant", "content": f"<think>\nChecks: {checks}\n</think>\n\nQh5."},
        {"role": "user", "content": f"After g6, legal moves: Kf1 {checks} Ke2"},
        {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\nQg4."},
    ]
    calls = served(qwen3, messages)
    assert trajectory_causes(calls, qwen3) == ["history rewrite", "whitespace"]  # the dropped reasoning
    calls[0]["finish_reason"] = "length"  # a turn cut off has no end to match: the shared text decides
    assert len(trajectory_causes(calls, qwen3)) > 2  # matched inside the next message: stretches around it


def test_a_user_turn_the_client_changed_between_calls_is_other(tokenizer):
    calls = two_moves(tokenizer)
    resent(tokenizer, calls[1], 1, {"role": "user", "content": "White to move."})  # moves list cut
    assert trajectory_causes(calls, tokenizer) == ["other", "whitespace"]


def test_a_move_sampled_in_pieces_is_a_spelling_in_any_turn(tokenizer):
    first, last = two_moves(tokenizer), two_moves(tokenizer)
    in_pieces(tokenizer, first[0], "Qh5")
    in_pieces(tokenizer, last[1], "Qg4")
    assert trajectory_causes(first, tokenizer) == ["spelling", "whitespace"]
    assert trajectory_causes(last, tokenizer) == ["spelling", "whitespace"]
    assert [spellings(c, tokenizer) for c in first] == [
        {"tool_calls": 1, "arguments": 1, "text": 0},
        {"tool_calls": 1, "arguments": 0, "text": 0},
    ]


def test_the_templates_newline_after_the_last_turn_is_whitespace_and_identical_ids_no_difference(tokenizer):
    for calls in (two_moves(tokenizer), two_moves(tokenizer)[:1]):
        assert trajectory_causes(calls, tokenizer) == ["whitespace"]
        calls[-1]["completion_token_ids"] += tokenizer.encode("\n", add_special_tokens=False)
        assert trajectory_causes(calls, tokenizer) == []


def test_a_stretchs_cause_is_the_first_that_holds(tokenizer):
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    pieces = tokenizer.convert_tokens_to_ids(list("Qh5"))
    for in_turn in (False, True):
        assert cause(tokenizer, pieces, ids("Qh5"), in_turn) == "spelling"
        assert cause(tokenizer, ids(': "'), ids(':"'), in_turn) == (
            "history rewrite" if in_turn else "whitespace"
        )
        assert cause(tokenizer, ids("e4"), ids("d4"), in_turn) == ("history rewrite" if in_turn else "other")
    assert cause(tokenizer, [], ids("\n"), False) == "whitespace"
    assert cause(tokenizer, [tokenizer.eos_token_id], ids("\n"), False) == "special tokens"
    assert cause(tokenizer, ids("<tool_call>"), [], False) == "special tokens"
    as_text = plain_ids(tokenizer, ["<tool_call>"])[0]  # the marker re-rendered as characters
    assert len(as_text) > 1 and cause(tokenizer, ids("<tool_call>"), as_text, True) == "special tokens"


def test_content_sampled_in_pieces_is_a_noncanonical_text_stretch(qwen3):
    calls = served(qwen3, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    (call,) = calls
    assert spellings(call, qwen3) == {"tool_calls": 0, "arguments": 0, "text": 0}
    at = call["completion_token_ids"].index(qwen3.convert_tokens_to_ids("Hello"))
    call["completion_token_ids"][at : at + 1] = qwen3.convert_tokens_to_ids(["H", "ello"])
    assert spellings(call, qwen3) == {"tool_calls": 0, "arguments": 0, "text": 1}
    assert trajectory_causes(calls, qwen3) == ["spelling", "whitespace"]


def test_a_call_written_with_other_spacing_is_checked_whole_for_its_spelling(tokenizer):
    """The parser re-serializes a compact call's arguments (`{"san": "Qh5"}`), text the completion
    does not hold: the call's whole text is then the stretch checked."""
    text = '<tool_call>{"name":"move","arguments":{"san":"Qh5"}}</tool_call><|im_end|>'
    call = {"completion_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    assert spellings(call, tokenizer) == {"tool_calls": 1, "arguments": 0, "text": 0}
    in_pieces(tokenizer, call, "Qh5")
    assert spellings(call, tokenizer) == {"tool_calls": 1, "arguments": 1, "text": 0}


def round_of_five(tokenizer) -> list[dict]:
    """Five trajectories: arguments rewritten (2 calls), a move in pieces (2), one call, identical
    (2), and a text completion that has no conversation (1)."""
    rewritten = two_moves(tokenizer, first='{"san":"Qh5"}', trajectory="rewritten")
    resent(tokenizer, rewritten[1], 2, move({"san": "Qh5"}))
    pieces = two_moves(tokenizer, trajectory="pieces")
    in_pieces(tokenizer, pieces[0], "Qh5")
    identical = two_moves(tokenizer, trajectory="identical")
    identical[1]["completion_token_ids"] += tokenizer.encode("\n", add_special_tokens=False)
    text = {**two_moves(tokenizer, trajectory="text")[0], "messages_json": '{"prompt": "1. e4"}'}
    return [*rewritten, *pieces, *two_moves(tokenizer, trajectory="one")[:1], *identical, text]


def test_a_rounds_trajectories_by_cause(tokenizer):
    rows, totals = round_causes(round_of_five(tokenizer), tokenizer)
    assert {r["trajectory_id"]: r.get("causes") for r in rows} == {
        "rewritten": {"history rewrite": 1, "whitespace": 1},
        "pieces": {"spelling": 1, "whitespace": 1},
        "one": {"whitespace": 1},
        "identical": {},
        "text": None,
    }
    assert rows[-1]["error"] == "call text-0: not a chat call (a text completion has no conversation)"
    assert totals == {
        "trajectories": 5,
        "multi-turn": 3,
        "not rendered": 1,
        "differ": 3,
        "multi-turn not rendered": 0,
        "multi-turn differ": 2,
        "multi-turn differ not only in whitespace": 2,
        "multi-turn: history rewrite": 1,
        "multi-turn: whitespace": 2,
        "multi-turn: spelling": 1,
        "stretches: history rewrite": 1,
        "stretches: whitespace": 3,
        "stretches: spelling": 1,
    }
    assert round_spellings(round_of_five(tokenizer), tokenizer) == {
        "completions": 8,
        "noncanonical completions": 1,
        "tool calls": 8,
        "noncanonical tool calls": 1,
    }


def test_a_conversation_the_template_refuses_is_counted_not_rendered_saying_why():
    gemma = family_tokenizer("gemma3")  # its template raises on two user turns in a row
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, move('{"san": "Qh5"}')]
    call = {
        "call_id": "c-0",
        "trajectory_id": "t",
        "call_index": 0,
        "prompt_token_ids": [1],
        "completion_token_ids": [2],
        "messages_json": json.dumps(messages),
    }
    rows, totals = round_causes([call], gemma)
    assert totals == {"trajectories": 1, "multi-turn": 0, "not rendered": 1, "multi-turn not rendered": 0}
    assert rows == [
        {
            "trajectory_id": "t",
            "calls": 1,
            "error": "call c-0: the chat template cannot render it: "
            "Conversation roles must alternate user/assistant/user/assistant/...",
        }
    ]


def test_recorded_lab_calls_are_spelled_canonically(recorded, tokenizer):
    n = len(recorded.calls)
    assert round_spellings(recorded.calls, tokenizer) == {
        "completions": n,
        "noncanonical completions": 0,
        "tool calls": n,
        "noncanonical tool calls": 0,
    }


def test_the_command_reports_a_rounds_calls(tmp_path, tokenizer):
    store = DeltaStore(tmp_path / "tables")
    store.overwrite_round("calls", round_of_five(tokenizer), 1)
    command = [sys.executable, "-m", "prodrl_pipeline.rl.retokenize", str(tmp_path / "tables")]
    done = subprocess.run(
        [*command, "--round", "1", "--tokenizer", "data/tokenizer", "--trajectories"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "round 1: 8 calls in 5 trajectories (3 multi-turn), 1 not rendered",
        "retokenized whole, the ids differ in 3 of 4 rendered trajectories, 2 of 3 rendered multi-turn "
        "(66.7%; other than in whitespace 66.7%)",
        "cause            multi-turn  share %  stretches",
        "history rewrite           1     33.3          1",
        "spelling                  1     33.3          1",
        "whitespace                2     66.7          3",
        "special tokens            0      0.0          0",
        "other                     0      0.0          0",
        "non-canonical spellings: 1 of 8 completions (125.0 per 1,000), 1 of 8 tool calls (125.0 per 1,000)",
        "rewritten  2 calls: history rewrite 1, whitespace 1",
        "pieces  2 calls: spelling 1, whitespace 1",
        "one  1 call: whitespace 1",
        "text  1 call: not rendered: call text-0: not a chat call (a text completion has no conversation)",
    ]
    empty = subprocess.run(
        [*command, "--round", "2", "--tokenizer", "data/tokenizer"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert empty.returncode == 1 and "no calls recorded in round 2" in empty.stderr
