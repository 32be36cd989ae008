"""The gateway's input checks at their edges, in-process (no server): which trajectory ids are taken
and from where, the logit_bias and prompt token-id bounds against the vocabulary, the completion
room, stop strings' limits, and a reply that a stop string (or the end token) ends before it shows
anything. Each bound is checked on both sides, against values written out by hand."""

import asyncio
import json
import string
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from pydantic import ValidationError

from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.engine.rows import Completion
from prodrl_pipeline.gateway.protocol import ChatRequest, CompletionRequest, ParamError
from prodrl_pipeline.gateway.responses import Ending, TokenFeed, chat_stream, cut_at_stop, stop_at, text_of
from prodrl_pipeline.gateway.serving import GatewayConfig, Serving
from prodrl_pipeline.records import support

USER = [{"role": "user", "content": "hi"}]
TOKENIZER = load_tokenizer("data/tokenizer")


def _trajectory(header=None, metadata=None, user=None) -> str:
    req = ChatRequest(messages=USER, metadata=metadata, user=user)
    return Serving.trajectory_of(req, header, "call-7")


def test_any_trajectory_id_is_taken_exactly_as_given():
    """Any string OpenAI accepts names a trajectory, kept as data (docs/gateway.md): every printable
    character and a few others, alone and inside an id, long ones, SQL-looking ones."""
    odd = [*string.printable, "é", "ß", "\u00a0", "\u2028", "٣", "\x00", "\x7f"]
    ids = [t for c in odd for t in (c, f"ab{c}", f"{c}ab", f"a{c}b")]
    ids += ["x" * 257, "ok\nbad", "a'; DROP TABLE calls; --", "alice@example.com", "user 42"]
    for tid in ids:
        assert _trajectory(metadata={"trajectory_id": tid}) == tid
        assert _trajectory(user=tid) == tid
    assert _trajectory(header="a%20b%C3%A9") == "a bé"  # the header is percent-decoded


def test_the_first_trajectory_id_given_wins_an_empty_one_is_not_given_and_none_means_the_call_id():
    assert _trajectory() == "call-7"
    assert _trajectory(header="", metadata={"trajectory_id": ""}, user="") == "call-7"
    assert _trajectory(header="h", metadata={"trajectory_id": "m"}, user="u") == "h"
    assert _trajectory(header="", metadata={"trajectory_id": "m"}, user="u") == "m"
    assert _trajectory(metadata={"other": "x"}, user="u") == "u"


def _deployment(vocab: int = 50, positions: int = 10, honours=("on_token", "logit_bias")) -> SimpleNamespace:
    engine = SimpleNamespace(vocab_size=vocab, honours=frozenset(honours), top_logprobs=5)
    return SimpleNamespace(engine=SimpleNamespace(engine=engine), max_positions=positions)


def _sampling(req, prompt=(1, 2), **deployment):
    serving = Serving(GatewayConfig(default_max_tokens=4), None, TOKENIZER, None, None)
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


def test_the_sampling_parameters_are_the_request_s_and_top_logprobs_are_bounded_by_the_engine_s():
    req = ChatRequest(messages=USER, temperature=0.7, top_p=0.9, top_k=40, seed=-5, max_tokens=3)
    params = _sampling(req)
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.max_tokens) == (
        0.7,
        0.9,
        40,
        -5,
        3,
    )
    assert _sampling(ChatRequest(messages=USER)).seed is None
    # the engine records the top 5 (the fake deployment's): 5 may be shown, 6 may not
    assert _sampling(ChatRequest(messages=USER, logprobs=True, top_logprobs=5)) is not None
    assert _sampling(ChatRequest(messages=USER, logprobs=True)) is not None  # True is not a count
    assert _refused(ChatRequest(messages=USER, logprobs=True, top_logprobs=6)) == (
        "top_logprobs",
        "this gateway records the top 5 log-probs",
    )
    assert _sampling(CompletionRequest(prompt=[1], logprobs=5), [1]) is not None
    assert _refused(CompletionRequest(prompt=[1], logprobs=6), [1]) == (
        "logprobs",
        "this gateway records the top 5 log-probs",
    )


def test_an_expired_trajectory_is_refused_and_unscored_ones_expire_once_into_rejects(tmp_path, another_zone):
    from prodrl_pipeline.gateway.landing import LandingLog
    from prodrl_pipeline.gateway.serving import expire_unscored
    from prodrl_pipeline.gateway.sessions import SessionIndex
    from prodrl_pipeline.records.store import DeltaStore

    store = DeltaStore(tmp_path / "tables")
    landing = LandingLog(store, tmp_path / "spool")
    landing.start()
    sessions = SessionIndex(0.01)
    for tid in ("t1", "t2", "t3"):
        sessions.next_call_index(tid)
    assert sessions.claim_reward("t2", overwrite=False) == "ok"  # scored: never expires
    time.sleep(0.05)
    before = datetime.now(UTC)
    assert expire_unscored(landing, sessions) == 2
    after = datetime.now(UTC)
    assert expire_unscored(landing, sessions) == 0  # once
    sessions.next_call_index("t4")
    time.sleep(0.05)
    assert expire_unscored(None, sessions) == 1  # not recording: expired all the same
    landing.stop()
    rows = sorted(store.read("rejects").to_pylist(), key=lambda r: r["record_id"])
    assert [before <= r.pop("rejected_at") <= after for r in rows] == [True, True]  # in UTC
    reason = "no reward within the TTL of 0.01 s"
    assert rows == [
        {
            "table_name": "landing_trajectories",
            "round": None,
            "record_id": t,
            "reason": reason,
            "record_json": "{}",
        }
        for t in ("t1", "t3")
    ]
    serving = Serving(GatewayConfig(), None, TOKENIZER, None, sessions)
    with pytest.raises(HTTPException) as refused:
        serving.open_trajectory(ChatRequest(messages=USER), "t1", "call-1")
    assert refused.value.status_code == 409
    assert refused.value.detail == "trajectory 't1' expired unscored (TTL 0.01 s); start a new trajectory id"
    assert serving.open_trajectory(ChatRequest(messages=USER), "t2", "call-2") == "t2"
    assert serving.open_trajectory(ChatRequest(messages=USER), None, "call-3") == "call-3"


def test_the_metrics_page_lists_each_outcome_then_each_gauge():
    serving = Serving(GatewayConfig(), None, TOKENIZER, None, None)
    assert serving.metrics.render({}) == "\n"
    serving.metrics.counts["client_gone"] += 1
    serving.metrics.counts["chat"] += 2
    assert serving.metrics.render({"pending": 3, "sessions": 2.5}) == (
        'prodrl_gateway_requests_total{outcome="chat"} 2\n'
        'prodrl_gateway_requests_total{outcome="client_gone"} 1\n'
        "prodrl_gateway_pending 3\n"
        "prodrl_gateway_sessions 2.5\n"
    )


@pytest.fixture
def another_zone(monkeypatch):
    """The machine's local time 5 h 45 min ahead of UTC: a naive local timestamp would land wrong."""
    monkeypatch.setenv("TZ", "Asia/Kathmandu")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_served_call_is_recorded_field_by_field_and_its_prefix_continuity_counted(tmp_path, another_zone):
    import numpy as np

    from prodrl_pipeline.engine.processing import SamplingParams
    from prodrl_pipeline.gateway.landing import LandingLog
    from prodrl_pipeline.gateway.sessions import SessionIndex
    from prodrl_pipeline.records.store import DeltaStore

    store = DeltaStore(tmp_path / "tables")
    landing = LandingLog(store, tmp_path / "spool")
    landing.start()
    serving = Serving(GatewayConfig(), None, TOKENIZER, landing, SessionIndex(60.0))
    dep = SimpleNamespace(
        deployment_id="dep-1", engine=SimpleNamespace(engine=SimpleNamespace(vocab_size=50))
    )
    done = Completion(
        token_ids=[5, 6],
        logprobs=[-0.5, -0.25],
        topk_ids=[np.array([5, 7]), np.array([6, 8])],
        topk_logprobs=[np.array([-0.5, -1.5], dtype=np.float32), np.array([-0.25, -2.0], dtype=np.float32)],
        supports=[support.unrestricted(50), support.from_ids([6, 8, 20], 2, 50)],  # 7 bytes < 3 ids
        extra_ids=[np.array([9], dtype=np.int64), np.array([6], dtype=np.int64)],
        finish_reason="stop",
    )
    params = SamplingParams(temperature=0.5, top_k=2, max_tokens=2, logit_bias=((3, -1.5),))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "e4"}]
    calls = (
        ("c0", "t1", [1, 2]),
        ("o0", "t2", [4]),  # another trajectory's first call: continues nothing
        ("c1", "t1", [1, 2, 5, 6, 9]),  # extends c0's prompt + completion
        ("c2", "t1", [1, 2, 5, 6, 9, 5, 6]),  # extends c1's
        ("c3", "t1", [1, 3]),  # breaks
    )
    before = datetime.now(UTC)
    for call, tid, prompt in calls:
        asyncio.run(serving.record(dep, call, tid, prompt, done, params, 123, messages))
    after = datetime.now(UTC)
    assert serving.metrics.prefix == {"extends": 2, "breaks": 1}
    quiet = Serving(GatewayConfig(record=False), None, TOKENIZER, landing, serving.sessions)
    asyncio.run(quiet.record(dep, "c4", "t1", [1], done, params, 123, messages))  # counted, not recorded
    landing.stop()
    rows = sorted(store.read("landing_calls").to_pylist(), key=lambda r: r["call_id"])
    assert [before <= r.pop("created_at") <= after for r in rows] == [True] * 5  # in UTC
    index = {"c0": 0, "c1": 1, "c2": 2, "c3": 3, "o0": 0}
    assert rows == [
        {
            "call_id": call,
            "trajectory_id": tid,
            "call_index": index[call],
            "deployment_id": "dep-1",
            "canary_id": None,  # no canary routed it
            "arm": None,
            "prompt_token_ids": prompt,
            "completion_token_ids": [5, 6],
            "completion_logprobs": [-0.5, -0.25],
            "topk_token_ids": [[5, 7], [6, 8]],
            "topk_logprobs": [[-0.5, -1.5], [-0.25, -2.0]],
            "support_size": [50, 3],
            "support_form": [support.Form.VOCABULARY, support.Form.BITMASK],
            "support_token_ids": [[], []],
            "support_mask": [b"", b"\x40\x01\x10\x00\x00\x00\x00"],  # bits 6, 8 and 20
            "extra_token_ids": [[9], [6]],
            "vocab_size": 50,
            "grammar": None,  # no grammar constrained it
            "sampling": {
                "temperature": 0.5,
                "top_p": 1.0,
                "top_k": 2,
                "max_tokens": 2,
                "seed": 123,
                "logit_bias": [{"token_id": 3, "bias": -1.5}],
            },
            "finish_reason": "stop",
            "messages_json": json.dumps(messages),
        }
        for call, tid, prompt in sorted(calls)
    ]
    assert serving.sessions.next_call_index("t1") == 5  # the unrecorded call took index 4
