"""OpenAI-schema response pieces built from a recorded completion."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.sampler import Completion


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


def logprobs_content(tokenizer: PreTrainedTokenizerBase, c: Completion, n: int) -> list[dict]:
    """Chat `logprobs.content`: each token's log-prob under mu and its top-n alternatives."""
    tok = tokenizer.convert_ids_to_tokens
    return [
        {
            "token": tok(t),
            "logprob": lp,
            "top_logprobs": [{"token": tok(i), "logprob": x} for i, x in zip(ids[:n], lps[:n], strict=True)],
        }
        for t, lp, ids, lps in zip(c.token_ids, c.logprobs, c.topk_ids, c.topk_logprobs, strict=True)
    ]


def usage(prompt_ids: list[int], c: Completion) -> dict:
    n = len(c.token_ids)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


async def chat_stream(
    tokenizer: PreTrainedTokenizerBase,
    model: str,
    call_id: str,
    created: int,
    c: Completion,
    message: dict,
    finish: str,
    ids: dict,
    logprobs: dict | None,
    usage_chunk: dict | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of a chat completion: role, then one content delta per token (their
    concatenation is the message text) or the tool calls, then the finish reason, the usage when
    asked (`stream_options.include_usage`: a chunk with no choices) and [DONE]."""

    def chunk(delta: dict, finish_reason: str | None = None, **extra) -> str:
        body = {
            "id": f"chatcmpl-{call_id}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"

    yield chunk({"role": "assistant", "content": ""}, prodrl=ids)
    if message.get("tool_calls"):
        if message["content"]:
            yield chunk({"content": message["content"]})
        yield chunk({"tool_calls": [{**tc, "index": i} for i, tc in enumerate(message["tool_calls"])]})
    else:
        shown, token_ids, content = "", shown_ids(tokenizer, c), message["content"]
        for i in range(1, len(token_ids) + 1):
            text = tokenizer.decode(token_ids[:i], skip_special_tokens=False)[: len(content)]  # to a stop
            if text.startswith(shown) and len(text) > len(shown):  # a partial UTF-8 char waits a token
                yield chunk({"content": text[len(shown) :]})
                shown = text
        if shown != message["content"]:
            yield chunk({"content": message["content"][len(shown) :]})
    final = chunk({}, finish)
    if logprobs:  # OpenAI puts them on the choice: choices[0].logprobs
        body = json.loads(final.removeprefix("data: "))
        body["choices"][0]["logprobs"] = logprobs
        final = f"data: {json.dumps(body)}\n\n"
    yield final
    if usage_chunk is not None:
        body = json.loads(chunk({}).removeprefix("data: "))
        yield f"data: {json.dumps({**body, 'choices': [], 'usage': usage_chunk})}\n\n"
    yield "data: [DONE]\n\n"
