"""OpenAI-schema response pieces built from a recorded completion."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.constraints import ConstraintError
from prodrl_pipeline.engine.rows import Completion
from prodrl_pipeline.gateway.errors import error_body


def shown_ids(tokenizer: PreTrainedTokenizerBase, c: Completion) -> list[int]:
    """The completion ids the client's text decodes from: all but a closing stop token."""
    if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] == tokenizer.eos_token_id:
        return c.token_ids[:-1]
    return c.token_ids


def text_of(tokenizer: PreTrainedTokenizerBase, c: Completion) -> str:
    return tokenizer.decode(shown_ids(tokenizer, c), skip_special_tokens=False)


def stop_at(tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]) -> Callable[[list[int]], bool]:
    """The engine's stop predicate for stop strings: does the text of the last tokens contain one?
    A string of L characters is at most 4L bytes, so it lies within the last 4L + 1 tokens."""
    window = 4 * max(len(s) for s in stops) + 1

    def stop(ids: list[int]) -> bool:
        tail = tokenizer.decode(ids[-window:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    return stop


def cut_at_stop(text: str, stops: Sequence[str] | None) -> str:
    """The text a client is shown: up to the first stop string (not included), as OpenAI does."""
    cuts = [i for i in (text.find(s) for s in stops or ()) if i >= 0]
    return text[: min(cuts)] if cuts else text


def held(text: str, holds: Sequence[str]) -> int:
    """How many of the text's last characters may still begin one of `holds`: the longest end of
    the text that is a proper beginning of one."""
    return max(
        (k for h in holds for k in range(min(len(h) - 1, len(text)), 0, -1) if text.endswith(h[:k])),
        default=0,
    )


def logprobs_content(tokenizer: PreTrainedTokenizerBase, c: Completion, n: int) -> list[dict]:
    """Chat `logprobs.content`: each token's log-prob under mu and its top-n alternatives."""
    tok = tokenizer.convert_ids_to_tokens
    return [
        {
            "token": tok(t),
            "logprob": lp,
            "top_logprobs": [
                {"token": tok(i), "logprob": x}
                for i, x in zip(ids[:n].tolist(), lps[:n].tolist(), strict=True)
            ],
        }
        for t, lp, ids, lps in zip(c.token_ids, c.logprobs, c.topk_ids, c.topk_logprobs, strict=True)
    ]


def usage(prompt_ids: list[int], c: Completion) -> dict:
    n = len(c.token_ids)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


class IncrementalText:
    """The decoded text of a growing list of ids, decoding only the newest tokens (with the
    previous chunk as context); a partial UTF-8 character waits for the token that completes it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self._prefix = self._read = 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=False)
        after = decode(self.ids[self._prefix :], skip_special_tokens=False)
        if after.endswith("\ufffd"):
            return
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)


class TokenFeed:
    """Items from the engine thread to one stream on the event loop, with one loop wake-up per
    burst: tokens that arrive before the loop gets to the stream are taken together (one SSE
    chunk), so a busy loop sends fewer, larger chunks instead of falling behind."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.ready = loop, deque(), asyncio.Event()
        self.scheduled = False

    def put(self, item: object) -> None:
        """From any thread (RuntimeError once the loop is closed)."""
        self.items.append(item)  # before the flag is read: an item is never left unannounced
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.scheduled = False  # before the items are taken (see put)
        self.ready.set()

    async def take(self) -> list:
        """Every item put so far (waiting for one if there is none)."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return [self.items.popleft() for _ in range(len(self.items))]


@dataclass
class Ending:
    """What a streamed chat call ends with, once its completion is done (and recorded)."""

    message: dict
    finish_reason: str
    logprobs: dict | None
    usage: dict | None
    """Sent as a last chunk with no choices (`stream_options.include_usage`)."""


async def chat_stream(
    tokenizer: PreTrainedTokenizerBase,
    model: str,
    call_id: str,
    created: int,
    head: dict,
    tokens: TokenFeed,
    end: Callable[[], Awaitable[Ending]],
    abandon: Callable[[], None],
    stops: Sequence[str] | None = None,
    call_starts: Sequence[str] = (),
) -> AsyncIterator[str]:
    """Server-sent events of a chat completion as its tokens arrive (`tokens`: (n, id) for the
    n-th completion token, then None; a repeated n is ignored; the tokens taken together make one
    chunk). Content deltas follow the decoded text up to a stop string or one of `call_starts` (the
    texts a tool call opens with), holding back an end that may still become one (`held`); from
    there on, text waits for the end. `end()` gives the final
    message (and fills `head`'s token ids); what it adds to the streamed text, the tool calls, the
    finish reason and the usage follow, then [DONE]. A stream closed early (the client left) calls
    `abandon()`; an engine error ends the stream with an error event."""

    def chunk(delta: dict | None, finish_reason: str | None = None, **extra) -> str:
        body = {
            "id": f"chatcmpl-{call_id}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason}] if delta is not None else []
        return f"data: {json.dumps({**body, 'choices': choices, **extra})}\n\n"

    holds = [*(stops or ()), *call_starts]
    try:
        yield chunk({"role": "assistant", "content": ""}, prodrl=head)
        text, seen, shown, quiet, over = IncrementalText(tokenizer), 0, "", False, False
        while not over:
            for item in await tokens.take():
                if item is None:
                    over = True
                    break
                n, token = item
                if n <= seen:
                    continue
                seen = n
                if not quiet and token != tokenizer.eos_token_id:
                    text.add(token)
            cut = cut_at_stop(text.text, holds)  # text only grows: a stop string stays found
            quiet = quiet or len(cut) < len(text.text)  # after a stop string or a call nothing is shown
            target = cut if quiet else text.text[: len(text.text) - held(text.text, holds)]
            if target.startswith(shown) and len(target) > len(shown):
                yield chunk({"content": target[len(shown) :]})
                shown = target
        ending = await end()
    except (asyncio.CancelledError, GeneratorExit):  # the client left
        abandon()
        raise
    except ConstraintError as e:  # the request's grammar failed mid-way: its fault, nothing recorded
        yield f"data: {json.dumps(error_body(400, str(e), 'response_format'))}\n\n"
        return
    except Exception as e:  # noqa: BLE001 - the engine failed: the stream ends with an error event
        yield f"data: {json.dumps(error_body(500, f'generation failed: {e}'))}\n\n"
        return
    message = ending.message
    if message["content"].startswith(shown) and len(message["content"]) > len(shown):
        yield chunk({"content": message["content"][len(shown) :]})
    if message.get("reasoning_content"):  # harmony's analysis channel (gpt-oss), sent whole
        yield chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("tool_calls"):
        yield chunk({"tool_calls": [{**tc, "index": i} for i, tc in enumerate(message["tool_calls"])]})
    final = json.loads(chunk({}, ending.finish_reason, prodrl=head).removeprefix("data: "))  # with token_ids
    if ending.logprobs:  # OpenAI puts them on the choice: choices[0].logprobs
        final["choices"][0]["logprobs"] = ending.logprobs
    yield f"data: {json.dumps(final)}\n\n"
    if ending.usage is not None:
        yield chunk(None, usage=ending.usage)
    yield "data: [DONE]\n\n"
