"""The streamed chat body against the final message, with the real tokenizer."""

import asyncio
import json

from prodrl_pipeline.gateway.responses import Ending, IncrementalText, TokenFeed, chat_stream, cut_at_stop


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
