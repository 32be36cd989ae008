"""The gateway's input checks at their edges, in-process (no server): which trajectory ids are taken
and from where, the logit_bias and prompt token-id bounds against the vocabulary, the completion
room, stop strings' limits, and a reply that a stop string (or the end token) ends before it shows
anything. Each bound is checked on both sides, against values written out by hand."""

import asyncio
import json
import string
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from pydantic import ValidationError

from prodrl_pipeline.engine.rows import Completion
from prodrl_pipeline.gateway.protocol import ChatRequest, CompletionRequest, ParamError
from prodrl_pipeline.gateway.responses import Ending, TokenFeed, chat_stream, cut_at_stop, stop_at, text_of
from prodrl_pipeline.gateway.serving import GatewayConfig, Serving

USER = [{"role": "user", "content": "hi"}]
TRAJECTORY_CHARACTERS = set(string.ascii_letters + string.digits + "_.:-")  # docs/gateway.md
RULE = "a trajectory id is 1-256 characters of [A-Za-z0-9_.:-]"


def _trajectory(header=None, metadata=None, user=None) -> str:
    req = ChatRequest(messages=USER, metadata=metadata, user=user)
    return Serving.trajectory_of(req, header, "call-7")


def _refused_trajectory(**given) -> str:
    with pytest.raises(HTTPException) as refused:
        _trajectory(**given)
    assert refused.value.status_code == 400
    return refused.value.detail


def test_a_trajectory_id_is_one_to_256_characters_of_its_class_and_nothing_else():
    for tid in ("a", "Z", "0", "-", ".", ":", "_", "x" * 256, "run-3:traj_0.1"):
        assert _trajectory(header=tid) == tid
        assert _trajectory(metadata={"trajectory_id": tid}) == tid
        assert _trajectory(user=tid) == tid
    # every printable ASCII character, a few others, alone and inside an id (not just at its start)
    for c in [*string.printable, "é", "ß", "\u00a0", "\u2028", "٣", "\x00", "\x7f"]:
        for tid in (c, f"ab{c}", f"{c}ab", f"a{c}b"):
            if set(tid) <= TRAJECTORY_CHARACTERS:
                assert _trajectory(header=tid) == tid
            else:
                assert _refused_trajectory(header=tid) == f"X-Prodrl-Trajectory-Id: {RULE}"
    for tid in ("x" * 257, "ok\n", "ok\nbad", "a'; DROP TABLE calls; --"):
        assert _refused_trajectory(header=tid).startswith("X-Prodrl-Trajectory-Id: ")
        assert _refused_trajectory(metadata={"trajectory_id": tid}).startswith("metadata.trajectory_id: ")
    assert _refused_trajectory(user="bad id").startswith("user: ")  # `user` is at most 256 characters anyway
    with pytest.raises(ValidationError):
        ChatRequest(messages=USER, user="x" * 257)


def test_the_first_trajectory_id_given_wins_an_empty_one_is_not_given_and_none_means_the_call_id():
    assert _trajectory() == "call-7"
    assert _trajectory(header="", metadata={"trajectory_id": ""}, user="") == "call-7"
    assert _trajectory(header="h", metadata={"trajectory_id": "m"}, user="u") == "h"
    assert _trajectory(header="", metadata={"trajectory_id": "m"}, user="u") == "m"
    assert _trajectory(metadata={"other": "x"}, user="u") == "u"
    # the first one given is the one checked: a bad later one is never read, a bad first one refused
    assert _trajectory(header="h", metadata={"trajectory_id": "bad id"}) == "h"
    assert _refused_trajectory(header="bad id", metadata={"trajectory_id": "m"}).startswith("X-Prodrl")


def _deployment(vocab: int = 50, positions: int = 10, honours=("on_token", "logit_bias")) -> SimpleNamespace:
    engine = SimpleNamespace(vocab_size=vocab, honours=frozenset(honours), top_logprobs=5)
    return SimpleNamespace(engine=SimpleNamespace(engine=engine), max_positions=positions)


def _sampling(req, prompt=(1, 2), **deployment):
    serving = Serving(GatewayConfig(default_max_tokens=4), None, None, None, None)
    param = "messages" if isinstance(req, ChatRequest) else "prompt"
    return serving.sampling(_deployment(**deployment), list(prompt), req, param)


def _refused(req, prompt=(1, 2), **deployment) -> tuple[str, str]:
    with pytest.raises(ParamError) as refused:
        _sampling(req, prompt, **deployment)
    return refused.value.param, str(refused.value)


def test_logit_bias_token_ids_are_in_zero_to_vocab_minus_one():
    def bias(**ids):
        return ChatRequest(messages=USER, logit_bias=ids)

    given = bias(**{"49": 1.5, "0": -100, "7": 100})
    assert _sampling(given).logit_bias == ((0, -100.0), (7, 100.0), (49, 1.5))  # vocab - 1 and 0 taken
    assert _sampling(bias(**{"0000000049": 2})).logit_bias == ((49, 2.0),)  # ten digits, leading zeros
    for token in ("50", "51", "4294967295"):  # the vocabulary's size and beyond
        assert _refused(bias(**{token: 1.0})) == ("logit_bias", "logit_bias token ids must be in [0, 50)")
    assert _refused(bias(**{"49": 1.0, "50": 1.0}))[0] == "logit_bias"  # one bad id among good ones
    assert _sampling(bias(**{"50": 1.0}), vocab=51).logit_bias == ((50, 1.0),)
    for token in ("-1", "-0", "+5", " 5", "5 ", "1e3", "٣", "", "00000000049"):  # not decimal ids (11 digits)
        with pytest.raises(ValidationError, match="logit_bias keys are token ids"):
            bias(**{token: 1.0})
    for value in (100.5, -100.01, float("nan"), float("inf")):
        with pytest.raises(ValidationError, match=r"logit_bias values are in \[-100, 100\]"):
            bias(**{"3": value})
    with pytest.raises(ValidationError, match="names a token id twice"):
        bias(**{"7": 1, "007": 2})
    assert _refused(bias(**{"3": 1.0}), honours=("on_token",)) == (
        "logit_bias",
        "logit_bias is not supported by this gateway's engine yet",
    )


def test_prompt_token_ids_are_in_zero_to_vocab_minus_one():
    for prompt in ([0, 49], [49]):
        assert _sampling(CompletionRequest(prompt=prompt), prompt).max_tokens == 4
    for prompt in ([50], [1, 50], [-1], [1, -1, 2]):
        assert _refused(CompletionRequest(prompt=prompt), prompt) == (
            "prompt",
            "prompt token ids must be in [0, 50)",
        )


def test_the_completion_fits_the_positions_left_after_the_prompt():
    def asked(n):
        return ChatRequest(messages=USER, max_tokens=n)

    assert _sampling(asked(6), prompt=range(4)).max_tokens == 6  # 4 + 6 = the 10 positions
    assert _refused(asked(7), prompt=range(4)) == (
        "max_tokens",
        "the prompt (4 tokens) + max_tokens (7) exceeds the 10 positions",
    )
    unasked = ChatRequest(messages=USER)
    assert _sampling(unasked, prompt=range(9)).max_tokens == 1  # the room left, not the default 4
    assert _sampling(unasked, prompt=range(5)).max_tokens == 4  # the default, with room 5
    assert _refused(ChatRequest(messages=USER), prompt=range(10)) == (
        "messages",
        "the prompt (10 tokens) exceeds the 10 positions",
    )
    with_completion = ChatRequest(messages=USER, max_completion_tokens=6, max_tokens=6)
    assert _sampling(with_completion, prompt=range(4)).max_tokens == 6


def test_stop_takes_one_to_four_strings_of_one_to_128_characters():
    for stop in ("x", "x" * 128, ["a", "b", "c", "d"], []):
        req = ChatRequest(messages=USER, stop=stop)
        assert req.stop == ([stop] if isinstance(stop, str) else stop)
        assert _sampling(req) is not None
    for stop in ("", "x" * 129, ["a", ""], ["a", "b", "c", "d", "e"]):
        with pytest.raises(ValidationError, match="stop takes at most 4 strings of 1-128 characters"):
            ChatRequest(messages=USER, stop=stop)
    assert _refused(ChatRequest(messages=USER, stop="x"), honours=("logit_bias",)) == (
        "stop",
        "stop strings are not supported by this gateway's engine yet",
    )


def test_a_stop_string_at_the_very_start_cuts_the_whole_reply():
    assert cut_at_stop("STOP and more", ["STOP"]) == ""
    assert cut_at_stop("STOP and more", ["more", "STOP"]) == ""  # the earliest, not the first listed
    assert cut_at_stop("aSTOP", ["STOP"]) == "a"
    assert cut_at_stop("a STOP b END", ["END", "STOP"]) == "a "
    assert cut_at_stop("STOP", ["STOP"]) == ""
    assert cut_at_stop("no stop here", ["STOP"]) == "no stop here"
    assert cut_at_stop("no stops given", None) == cut_at_stop("no stops given", []) == "no stops given"


def test_the_stop_predicate_fires_on_a_stop_string_in_the_first_token(tokenizer):
    ids = tokenizer.encode("Nf3 then more", add_special_tokens=False)
    first = tokenizer.decode(ids[:1], skip_special_tokens=False)
    assert stop_at(tokenizer, [first])(ids[:1])  # in the very first token
    assert stop_at(tokenizer, ["zz", first])(ids[:1])
    assert not stop_at(tokenizer, ["zz"])(ids[:1])
    assert not stop_at(tokenizer, ["more"])(ids[:1])


def test_a_reply_of_only_the_end_token_or_nothing_shows_empty_text(tokenizer):
    eos = tokenizer.eos_token_id
    assert text_of(tokenizer, Completion(token_ids=[eos], finish_reason="stop")) == ""
    assert text_of(tokenizer, Completion(token_ids=[], finish_reason="stop")) == ""
    assert text_of(tokenizer, Completion(token_ids=[], finish_reason="length")) == ""
    assert text_of(tokenizer, Completion(token_ids=[eos], finish_reason="length")) == tokenizer.decode(
        [eos], skip_special_tokens=False
    )  # only a stop's closing end token is hidden


def _events(tokenizer, ids: list[int], stops, content: str) -> list:
    """Every event of a chat stream fed `ids` one token a loop turn, the final message `content`."""

    async def run() -> list[str]:
        tokens = TokenFeed(asyncio.get_running_loop())

        async def feed() -> None:
            for n, t in enumerate(ids, 1):
                tokens.put((n, t))
                await asyncio.sleep(0)
            tokens.put(None)

        async def end() -> Ending:
            return Ending({"role": "assistant", "content": content}, "stop", None, None)

        feeding = asyncio.create_task(feed())
        lines = [
            line async for line in chat_stream(tokenizer, "m", "c", 0, {}, tokens, end, lambda: None, stops)
        ]
        await feeding
        return lines

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_stream_whose_reply_starts_with_a_stop_string_sends_no_content(tokenizer):
    """Text shorter than the longest stop string is held back whole: "STOP" arrives as S, T, O, P,
    and "ST" must not show its "S" (a negative slice end once did)."""
    for text, stops in (("STOP and then more text", ["STOP"]), ("Qxe7 more", ["Q", "more"])):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 1
        events = _events(tokenizer, ids, stops, cut_at_stop(text, stops))
        deltas = [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events]
        assert deltas == [({"role": "assistant", "content": ""}, None), ({}, "stop")], text
    # the end token alone: nothing shown either
    events = _events(tokenizer, [tokenizer.eos_token_id], None, "")
    assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant", "content": ""}, {}]
    # one character before the stop string is shown, and nothing after it
    events = _events(tokenizer, tokenizer.encode("xSTOP more", add_special_tokens=False), ["STOP"], "x")
    assert [e["choices"][0]["delta"].get("content") for e in events] == ["", "x", None]
    # a reply shorter than a stop string that never comes: held back, then sent whole at the end
    events = _events(tokenizer, tokenizer.encode("Hi", add_special_tokens=False), ["ZZZZ"], "Hi")
    assert [e["choices"][0]["delta"].get("content") for e in events] == ["", "Hi", None]
