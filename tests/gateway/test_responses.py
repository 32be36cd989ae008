"""The streamed chat body against the final message, with the real tokenizer."""

import asyncio
import json

from prodrl_pipeline.gateway.chat_format import TemplateChat
from prodrl_pipeline.gateway.responses import (
    Ending,
    IncrementalText,
    TokenFeed,
    chat_stream,
    cut_at_stop,
    held,
)
from tests.families import family_tokenizer


def _stream(tokenizer, ids: list[int], stops, whole: bool) -> tuple[str, dict, int]:
    """(the concatenated content deltas, the final message, the number of content chunks) of a
    stream fed `ids` one token per loop turn, or all before it starts (`whole`: one burst)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    message = {"role": "assistant", "content": cut_at_stop(text, stops)}

    async def run() -> list[str]:
        tokens = TokenFeed(asyncio.get_running_loop())

        async def feed() -> None:
            for n, t in enumerate(ids, 1):
                tokens.put((n, t))
                if n == 2:
                    tokens.put((n, t))  # a repeat (a retried admission) is ignored
                if not whole:
                    await asyncio.sleep(0)  # lets the stream take this token alone
            tokens.put(None)

        async def end() -> Ending:
            return Ending(message, "stop", None, None)

        feeding = asyncio.create_task(feed())
        if whole:
            await feeding
        head = {"call_id": "c"}
        stream = chat_stream(
            tokenizer,
            "m",
            "c",
            0,
            head,
            tokens,
            end,
            lambda: None,
            stops,
        )
        lines = [line async for line in stream]
        await feeding
        return lines

    lines = asyncio.run(run())
    deltas = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    contents = [d["choices"][0]["delta"].get("content") for d in deltas if d["choices"]]
    return "".join(c or "" for c in contents), message, sum(1 for c in contents if c)


def test_streamed_text_never_passes_a_stop_string_and_equals_the_message(tokenizer):
    for text, stops in (
        ("Hello END more text", ["END"]),
        ("line one\nline two", ["\n"]),
        ("abc ünï ✓ then STOP here", ["STOP", "zz"]),
        ("no stop at all", ["QQ"]),
        ("no stops given", None),
    ):
        ids = tokenizer.encode(text, add_special_tokens=False)
        shown, message, chunks = _stream(tokenizer, ids, stops, whole=False)
        assert shown == message["content"] == cut_at_stop(text, stops), (text, shown)
        burst, _, burst_chunks = _stream(tokenizer, ids, stops, whole=True)
        assert burst == shown and burst_chunks <= 2 < chunks  # one chunk (and the held-back end)


def test_incremental_text_equals_the_whole_decode(tokenizer):
    ids = tokenizer.encode("Nf3+ Qxe7# ünïcödé ✓✓ <|im_start|> done", add_special_tokens=False)
    text = IncrementalText(tokenizer)
    for t in ids:
        text.add(t)
    assert text.text == tokenizer.decode(ids, skip_special_tokens=False)


def _chars(tokenizer, text: str) -> list[int]:
    """`text` as one token per character (every ASCII character is a token of the byte-level BPE)."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in text]
    assert tokenizer.decode(ids) == text
    return ids


async def _lockstep(tokenizer, ids: list[int], stops, content: str, call_starts=()) -> tuple[list[str], list]:
    """The text shown after each token of a stream fed one token at a time (each given the loop
    until the stream waits again), and the events after the last token."""
    tokens = TokenFeed(asyncio.get_running_loop())

    async def end() -> Ending:
        return Ending({"role": "assistant", "content": content}, "stop", None, None)

    stream = chat_stream(tokenizer, "m", "c", 0, {}, tokens, end, lambda: None, stops, call_starts)
    assert json.loads((await anext(stream))[6:])["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    pending, shown = asyncio.ensure_future(anext(stream)), []

    async def settle() -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    for n, token in enumerate(ids, 1):
        tokens.put((n, token))
        await settle()
        while pending.done():
            shown.append(json.loads(pending.result()[6:])["choices"][0]["delta"]["content"])
            pending = asyncio.ensure_future(anext(stream))
            await settle()
        shown.append("|")  # token n's turn ends
    tokens.put(None)
    rest = [await pending] + [line async for line in stream]
    after = "".join(shown).split("|")[:-1]
    return [after[n] for n in range(len(ids))], [json.loads(x[6:]) for x in rest if x.startswith("data: {")]


def test_a_stream_holds_back_only_an_end_that_may_still_become_a_stop_string(tokenizer):
    """After each token the text is shown but its longest end that is a proper beginning of a stop
    string (nothing from a stop string on); the rest follows with the final message."""
    text = "abcdef"
    cases = {
        None: ["a", "ab", "abc", "abcd", "abcde", "abcdef"],
        ("xyz",): ["a", "ab", "abc", "abcd", "abcde", "abcdef"],  # no end of the text begins "xyz"
        ("q", "cdq"): ["a", "ab", "ab", "ab", "abcde", "abcdef"],  # "c", then "cd", may still be "cdq"
        ("cde",): ["a", "ab", "ab", "ab", "ab", "ab"],  # held, then cut at the stop string
        ("efg", "bcx"): ["a", "a", "a", "abcd", "abcd", "abcd"],  # "b" and "bc", then "e" and "ef" held
        ("a",): [""] * 6,  # the first character is a stop string: nothing is ever shown
    }
    for stops, expected in cases.items():
        content = cut_at_stop(text, stops)
        shown, rest = asyncio.run(_lockstep(tokenizer, _chars(tokenizer, text), stops, content))
        assert ["".join(shown[: n + 1]) for n in range(6)] == expected, stops
        tail = [e["choices"][0]["delta"].get("content") for e in rest]
        assert "".join(shown) + "".join(t or "" for t in tail) == content, stops


def test_held_is_the_longest_end_that_begins_a_held_string():
    assert held("abc", ["cde"]) == 1 and held("abcd", ["cde"]) == 2 and held("abcd", ["cdx", "d"]) == 2
    assert held("abc", ["abc"]) == 0  # a whole one is cut, not held
    assert held("ab", ["xabcdef"]) == 0 and held("", ["ab"]) == 0 and held("ab", []) == 0


def test_text_from_where_a_call_starts_waits_for_the_final_message(tokenizer):
    marker = tokenizer.convert_tokens_to_ids("<tool_call>")
    ids = [*_chars(tokenizer, "ok."), marker, *_chars(tokenizer, "{x}")]
    shown, _ = asyncio.run(_lockstep(tokenizer, ids, None, "ok.", ("<tool_call>",)))
    assert shown == ["o", "k", ".", "", "", "", ""]
    shown, _ = asyncio.run(_lockstep(tokenizer, ids, None, "ok.", call_starts=()))
    assert "".join(shown) == tokenizer.decode(ids)  # without a call start it is text like any other
    plain = _chars(tokenizer, 'ok{"n":1}')  # a family whose calls are bare JSON (Llama 3's)
    shown, _ = asyncio.run(_lockstep(tokenizer, plain, None, "ok", ('{"n',)))
    assert ["".join(shown[: n + 1]) for n in range(len(plain))][1:] == ["ok"] * (len(plain) - 1)


def test_the_separator_before_a_call_is_held_as_the_parsed_content_drops_it(tokenizer):
    """Qwen3 writes a newline between a turn's text and its call, and parsed content leaves it out:
    the stream holds it back with the call, so what it shows stays a prefix of the final content."""
    assert TemplateChat(family_tokenizer("qwen3")).stream_hold(True) == ("\n<tool_call>", "<tool_call>")
    newline = tokenizer.encode("\n", add_special_tokens=False)
    marker = tokenizer.convert_tokens_to_ids("<tool_call>")
    ids = [*_chars(tokenizer, "ok."), *newline, marker, *_chars(tokenizer, "{x}")]
    shown, rest = asyncio.run(_lockstep(tokenizer, ids, None, "ok.", ("\n<tool_call>", "<tool_call>")))
    assert "".join(shown) == "ok."
    assert not [e for e in rest if e["choices"] and e["choices"][0]["delta"].get("content")]


def _events_of(tokenizer, end, ids=()) -> list[str]:
    async def run() -> list[str]:
        tokens = TokenFeed(asyncio.get_running_loop())
        for n, t in enumerate(ids, 1):
            tokens.put((n, t))
        tokens.put(None)
        head = {"call_id": "c9"}
        return [
            line async for line in chat_stream(tokenizer, "dep-1", "c9", 77, head, tokens, end, lambda: None)
        ]

    return asyncio.run(run())


def test_every_chunk_is_openai_s_and_the_ending_brings_tool_calls_logprobs_and_usage(tokenizer):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "move", "arguments": "{}"}}] * 2
    logprobs = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}]}
    usage_ = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

    async def end() -> Ending:
        return Ending(
            {"role": "assistant", "content": "a", "tool_calls": calls}, "tool_calls", logprobs, usage_
        )

    lines = _events_of(tokenizer, end, _chars(tokenizer, "a"))
    envelope = {"id": "chatcmpl-c9", "object": "chat.completion.chunk", "created": 77, "model": "dep-1"}

    def choice(delta, finish=None, **extra):
        return [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]

    assert lines[-1] == "data: [DONE]\n\n" and all(x.endswith("\n\n") for x in lines)
    assert [json.loads(x.removeprefix("data: ")) for x in lines[:-1]] == [
        {**envelope, "choices": choice({"role": "assistant", "content": ""}), "prodrl": {"call_id": "c9"}},
        {**envelope, "choices": choice({"content": "a"})},
        {**envelope, "choices": choice({"tool_calls": [{**calls[0], "index": 0}, {**calls[1], "index": 1}]})},
        {**envelope, "choices": choice({}, "tool_calls", logprobs=logprobs), "prodrl": {"call_id": "c9"}},
        {**envelope, "choices": [], "usage": usage_},
    ]


def test_a_stream_whose_generation_fails_ends_with_the_error_event_and_no_done(tokenizer):
    from prodrl_pipeline.engine.constraints import ConstraintError

    for error, body in (
        (
            ConstraintError("the grammar gave up"),
            {"message": "the grammar gave up", "type": "invalid_request_error", "param": "response_format"},
        ),
        (
            RuntimeError("engine died"),
            {"message": "generation failed: engine died", "type": "server_error", "param": None},
        ),
    ):

        async def end(error=error) -> Ending:
            raise error

        lines = _events_of(tokenizer, end, _chars(tokenizer, "a"))
        assert lines[-1] == f"data: {json.dumps({'error': {**body, 'code': None}})}\n\n"
        assert "data: [DONE]\n\n" not in lines and len(lines) == 3  # the role, the text "a", the error


def test_tokens_put_in_one_burst_wake_the_loop_once():
    class Loop:
        def __init__(self):
            self.wakes = []

        def call_soon_threadsafe(self, callback):
            self.wakes.append(callback)

    async def run() -> None:
        loop = Loop()
        feed = TokenFeed(loop)
        for item in (1, 2, 3):
            feed.put(item)
        assert len(loop.wakes) == 1  # one wake-up for the burst
        loop.wakes[0]()  # the loop runs it: the next put schedules another
        assert await feed.take() == [1, 2, 3]
        feed.put(4)
        feed.put(5)
        assert len(loop.wakes) == 2
        loop.wakes[1]()
        assert await feed.take() == [4, 5]

    asyncio.run(run())


def test_a_stop_string_is_found_however_its_characters_split_into_tokens(tokenizer):
    from prodrl_pipeline.gateway.responses import stop_at

    four_bytes = "\U0001f0a1"  # one character, four byte tokens: the window of 4 L + 1 tokens holds it
    ids = tokenizer.encode(f"ab{four_bytes}", add_special_tokens=False)
    assert len(ids) == 6 and tokenizer.decode(ids[-4:]) == four_bytes
    assert stop_at(tokenizer, [four_bytes])(ids)
    assert not stop_at(tokenizer, [four_bytes])(ids[:-1])
    special = tokenizer.encode("a<|im_start|>b", add_special_tokens=False)  # special tokens are text here
    assert stop_at(tokenizer, ["<|im_start|>"])(special) and stop_at(tokenizer, ["a<|im_start|>b"])(special)
    assert cut_at_stop("one STOP two STOP", ["STOP"]) == "one "  # the first occurrence


def test_a_stop_s_end_token_is_hidden_and_the_rest_of_the_completion_shown(tokenizer):
    from prodrl_pipeline.engine.rows import Completion
    from prodrl_pipeline.gateway.responses import text_of

    eos, ids = tokenizer.eos_token_id, _chars(tokenizer, "ab")
    assert text_of(tokenizer, Completion(token_ids=[*ids, eos], finish_reason="stop")) == "ab"
    assert text_of(tokenizer, Completion(token_ids=ids, finish_reason="stop")) == "ab"


def test_usage_and_chat_logprobs_as_openai_gives_them(tokenizer):
    import numpy as np

    from prodrl_pipeline.engine.rows import Completion
    from prodrl_pipeline.gateway.responses import logprobs_content, usage

    a, b, c = _chars(tokenizer, "abc")
    done = Completion(
        token_ids=[a, b],
        logprobs=[-0.5, -1.25],
        topk_ids=[np.array([a, c, b]), np.array([c, b, a])],
        topk_logprobs=[np.array([-0.5, -1.0, -3.0]), np.array([-0.25, -1.25, -4.0])],
        finish_reason="length",
    )
    assert usage([7, 8, 9], done) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert logprobs_content(tokenizer, done, 2) == [
        {
            "token": "a",
            "logprob": -0.5,
            "top_logprobs": [{"token": "a", "logprob": -0.5}, {"token": "c", "logprob": -1.0}],
        },
        {
            "token": "b",
            "logprob": -1.25,
            "top_logprobs": [{"token": "c", "logprob": -0.25}, {"token": "b", "logprob": -1.25}],
        },
    ]
    assert [x["top_logprobs"] for x in logprobs_content(tokenizer, done, 0)] == [[], []]
