"""The naive retokenizing pipeline, kept to measure what it costs (docs/estimators.md).

Many RL stacks do not keep the served token ids: they rebuild each example from the stored
conversation through the chat template and tokenize the text again. `retokenize_call` does exactly
that with a recorded call:

- prompt ids: the template rendered over `messages_json` without its last (assistant) message, with
  the generation prompt, then tokenized; completion ids: the whole conversation rendered and
  tokenized, minus that many leading tokens (what a pipeline that masks the prompt by length does);
- recorded per-position data (sampled log-prob, head, support, extra samples) is kept on the
  completion's longest prefix whose ids equal the recorded ids; from the first disagreement on,
  a position gets NaN in place of the recorded log-probs, a head of just its own token, an
  unrestricted support, and its own token as every extra sample. The trainer fills NaN behaviour
  log-probs with its round-start pi_k, as a pipeline that recomputes log-probs would: such tokens
  look on-policy to every estimator, except samples-form score centering, where a token centered
  on copies of itself gets weight 0.

`retokenize_calls` also says where the new ids differ from the recorded ones.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from difflib import SequenceMatcher

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.records import support

NAN = math.nan


def _rendered(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[int]]:
    prompt = render_ids(tokenizer, messages[:-1])
    return prompt, render_ids(tokenizer, messages, add_generation_prompt=False)[len(prompt) :]


def retokenize_call(call: dict, tokenizer: PreTrainedTokenizerBase) -> dict:
    """`call` rebuilt from its conversation, recorded data aligned where the ids agree."""
    messages = json.loads(call["messages_json"])
    if not isinstance(messages, list):
        raise ValueError(f"call {call['call_id']}: not a chat call (a text completion has no conversation)")
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(f"call {call['call_id']}: messages_json does not end with the assistant's answer")
    prompt, completion = _rendered(tokenizer, messages)
    old = call["completion_token_ids"]
    extra = call.get("extra_token_ids") or []
    agree = [t < len(old) and tok == old[t] for t, tok in enumerate(completion)]
    prefix = agree.index(False) if False in agree else len(agree)
    keep = [t < prefix for t in range(len(completion))]  # after a shift, nothing lines up
    vocab = call["vocab_size"]
    kept, whole = support.of_call(call), support.unrestricted(vocab)

    def pick(column: str, t: int, fallback):  # noqa: ANN001, ANN202
        return call[column][t] if keep[t] else fallback

    n_extra = len(extra[0]) if extra else 0
    return {
        **call,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": [pick("completion_logprobs", t, NAN) for t in range(len(completion))],
        "topk_token_ids": [pick("topk_token_ids", t, [tok]) for t, tok in enumerate(completion)],
        "topk_logprobs": [pick("topk_logprobs", t, [NAN]) for t in range(len(completion))],
        **support.columns([kept[t] if keep[t] else whole for t in range(len(completion))]),
        "extra_token_ids": (
            [extra[t] if keep[t] else [tok] * n_extra for t, tok in enumerate(completion)] if extra else []
        ),
    }


def _kind(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    if not text.strip():
        return "template whitespace"
    if any(i in tokenizer.all_special_ids for i in ids):
        return "special tokens"
    if "{" in text or '"' in text:
        return "tool-call rendering"
    return "move or content tokens"


def retokenize_calls(calls: Iterable[dict], tokenizer: PreTrainedTokenizerBase) -> tuple[list[dict], dict]:
    """Every call retokenized, and where the new ids differ from the recorded ones: counts of calls
    and completion positions, differing prompts and completions, and each differing stretch of a
    completion (a token diff) by kind: template whitespace, special tokens, tool-call rendering,
    move or content tokens."""
    out: Counter = Counter()
    rebuilt = []
    for call in calls:
        new = retokenize_call(call, tokenizer)
        rebuilt.append(new)
        old_c, new_c = call["completion_token_ids"], new["completion_token_ids"]
        out["calls"] += 1
        out["positions"] += len(old_c)
        out["positions_retokenized"] += len(new_c)
        out["positions_aligned"] += sum(a == b for a, b in zip(new_c, old_c, strict=False))
        out["prompt_differs"] += new["prompt_token_ids"] != call["prompt_token_ids"]
        out["completion_differs"] += new_c != old_c
        # where they differ, by a token diff (the trainer's alignment above is positional)
        for op, i1, i2, j1, j2 in SequenceMatcher(None, old_c, new_c, autojunk=False).get_opcodes():
            if op != "equal":
                out[f"stretch: {_kind(tokenizer, old_c[i1:i2] + new_c[j1:j2])}"] += 1
    return rebuilt, dict(out)
