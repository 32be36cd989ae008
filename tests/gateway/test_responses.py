"""The streamed chat body against the final message, with the real tokenizer."""

import asyncio
import json

from prodrl_pipeline.gateway.responses import Ending, IncrementalText, chat_stream, cut_at_stop


def _stream(tokenizer, ids: list[int], stops, tool_open=None) -> tuple[str, dict]:
    """(the concatenated content deltas, the final message) of a stream fed `ids`."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    message = {"role": "assistant", "content": cut_at_stop(text, stops)}

    async def run() -> list[str]:
        tokens: asyncio.Queue = asyncio.Queue()
        for n, t in enumerate(ids, 1):
            tokens.put_nowait((n, t))
            if n == 2:
                tokens.put_nowait((n, t))  # a repeat (a retried admission) is ignored
        tokens.put_nowait(None)
        head = {"call_id": "c"}
        stream = chat_stream(
            tokenizer,
            "m",
            "c",
            0,
            head,
            tokens,
            lambda: Ending(message, "stop", None, None),
            lambda: None,
            stops,
        )
        return [line async for line in stream]

    lines = asyncio.run(run())
    deltas = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    content = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])
    return content, message


def test_streamed_text_never_passes_a_stop_string_and_equals_the_message(tokenizer):
    for text, stops in (
        ("Hello END more text", ["END"]),
        ("line one\nline two", ["\n"]),
        ("abc ünï ✓ then STOP here", ["STOP", "zz"]),
        ("no stop at all", ["QQ"]),
        ("no stops given", None),
    ):
        ids = tokenizer.encode(text, add_special_tokens=False)
        shown, message = _stream(tokenizer, ids, stops)
        assert shown == message["content"] == cut_at_stop(text, stops), (text, shown)


def test_incremental_text_equals_the_whole_decode(tokenizer):
    ids = tokenizer.encode("Nf3+ Qxe7# ünïcödé ✓✓ <|im_start|> done", add_special_tokens=False)
    text = IncrementalText(tokenizer)
    for t in ids:
        text.add(t)
    assert text.text == tokenizer.decode(ids, skip_special_tokens=False)
