"""Why retokenized ids differ from the served ones: each differing stretch by cause.

A pipeline that does not keep the served ids renders a trajectory's whole conversation once through
the chat template (its last call's `messages_json`, which ends with the final answer) and tokenizes
it. `trajectory_causes` diffs that rendering (difflib, by token) against what was served, as one
stream: the first call's prompt, each call's completion, and of each later call's prompt what
follows the previous call's prompt + completion (when it extends them), the re-rendered previous
completion (when that completion ended with its end-of-turn token), or the last stretch it shares
with them (when the client's history rendered otherwise). `cause` names each differing
stretch's cause, the first that holds:

- `spelling`: both sides decode to the same text, neither holds a control token: the engine
  sampled a non-canonical tokenization that re-encoding replaces by the canonical one;
- `history rewrite`: within a served assistant turn (a completion; `stretch_causes`), other text:
  the template renders the stored answer otherwise (Qwen3 drops reasoning from earlier turns and
  writes an empty reasoning block into the last, `tojson` re-serializes parsed tool-call arguments,
  content is trimmed);
- `whitespace`: the texts differ only in whitespace (the newline the template writes after the
  final end-of-turn token, which the engine never generated);
- `special tokens`: a side holds a special token or control marker (`chat.render.control_markers`;
  one the model wrote into an answer comes back as its characters' ids, the same text);
- `other`: anything else (a prompt whose history the client changed between calls).

`spellings` measures the first cause on completions alone: whether each sampled stretch's decoded
text re-encodes to its ids.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable
from difflib import SequenceMatcher
from functools import lru_cache
from itertools import groupby

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import control_markers, plain_ids, render_ids
from prodrl_pipeline.chat.tool_calls import tool_call_format

CAUSES = ("history rewrite", "spelling", "whitespace", "special tokens", "other")


def conversation(call: dict) -> list[dict]:
    """The call's `messages_json`: a chat conversation ending with the assistant's answer, or a
    ValueError naming the call."""
    messages = json.loads(call["messages_json"])
    if not isinstance(messages, list):
        raise ValueError(f"call {call['call_id']}: not a chat call (a text completion has no conversation)")
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(f"call {call['call_id']}: messages_json does not end with the assistant's answer")
    return messages


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@lru_cache(maxsize=16)
def _control_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    markers = tokenizer.convert_tokens_to_ids(list(control_markers(tokenizer)))
    return frozenset(tokenizer.all_special_ids) | frozenset(markers)


def cause(tokenizer: PreTrainedTokenizerBase, served: list[int], rendered: list[int], in_turn: bool) -> str:
    """The cause (module docstring) of one differing stretch: `served` ids where the rendering has
    `rendered`; `in_turn`: the stretch lies within a served assistant turn."""
    old, new = _text(tokenizer, served), _text(tokenizer, rendered)
    control = bool(_control_ids(tokenizer).intersection(served + rendered))
    if old == new:
        return "special tokens" if control else "spelling"
    if in_turn:
        return "history rewrite"
    if "".join(old.split()) == "".join(new.split()):
        return "whitespace"
    return "special tokens" if control else "other"


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _opcodes(a: list[int], b: list[int]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes of `a` -> `b` but "equal", the common prefix and suffix taken off first (a
    long conversation differs in few places; difflib's cost grows with each token's repeats)."""
    head, tail = _common_prefix(a, b), 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    middle = SequenceMatcher(None, a[head : len(a) - tail], b[head : len(b) - tail], autojunk=False)
    return [
        (op, i1 + head, i2 + head, j1 + head, j2 + head)
        for op, i1, i2, j1, j2 in middle.get_opcodes()
        if op != "equal"
    ]


def stretch_causes(
    tokenizer: PreTrainedTokenizerBase, served: list[int], rendered: list[int], turns: list[tuple[int, int]]
) -> list[str]:
    """The cause of each stretch where `rendered` differs from `served`, in order; `turns`: the
    [start, end) spans of `served` that are assistant turns. A stretch is within one when it
    overlaps it, or is an insertion at its start or inside it (one at its end follows the turn)."""
    out = []
    for _, i1, i2, j1, j2 in _opcodes(served, rendered):
        inside = any(i1 < end and (i2 > start or i1 == start) for start, end in turns)
        out.append(cause(tokenizer, served[i1:i2], rendered[j1:j2], inside))
    return out


def _resumes_at(previous: list[int], prompt: list[int], ended: bool) -> int:
    """Where `prompt` goes on from the previous call's prompt + completion: their end when it extends
    them; after the re-rendered completion when that completion `ended` with its end-of-turn token
    (the template ends each re-rendered turn with one: after as many of them, past what the two
    share, as the previous stream holds there); else the end of the last stretch the two share."""
    head = _common_prefix(previous, prompt)
    if head == len(previous):
        return head
    if ended:
        end, turns = previous[-1], previous[head:].count(previous[-1])
        ends = [t for t in range(head, len(prompt)) if prompt[t] == end]
        if len(ends) >= turns:
            return ends[turns - 1] + 1
    blocks = SequenceMatcher(None, previous[head:], prompt[head:], autojunk=False).get_matching_blocks()
    last = blocks[-2] if len(blocks) > 1 else None  # the list ends with a dummy of size 0
    return head + (last.b + last.size if last else 0)


def served_stream(calls: list[dict], control: frozenset[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """A trajectory's calls (in call order) as one served stream (module docstring), and the spans
    of its completions; `control`: the control-token ids (a completion ends its turn with one)."""
    stream: list[int] = []
    turns = []
    previous: list[int] | None = None
    ended = False
    for call in calls:
        prompt, completion = list(call["prompt_token_ids"]), list(call["completion_token_ids"])
        stream += prompt[_resumes_at(previous, prompt, ended) if previous is not None else 0 :]
        turns.append((len(stream), len(stream) + len(completion)))
        stream += completion
        previous = prompt + completion
        ended = call.get("finish_reason") == "stop" and bool(completion) and completion[-1] in control
    return stream, turns


def trajectory_causes(calls: Iterable[dict], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The cause of each stretch where the rendering of a trajectory's whole conversation differs
    from what its calls served (module docstring). ValueError, naming the last call, when the
    conversation cannot be rendered."""
    calls = sorted(calls, key=lambda c: c["call_index"])
    messages = conversation(calls[-1])
    try:
        rendered = render_ids(tokenizer, messages, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - render_ids' TemplateError, or the template's own (jinja2's)
        raise ValueError(f"call {calls[-1]['call_id']}: the chat template cannot render it: {e}") from e
    served, turns = served_stream(calls, _control_ids(tokenizer))
    return stretch_causes(tokenizer, served, rendered, turns)


def round_causes(calls: Iterable[dict], tokenizer: PreTrainedTokenizerBase) -> tuple[list[dict], dict]:
    """Every trajectory of `calls` retokenized whole: per trajectory its id, calls and stretches by
    cause (or the `error` that kept it from being rendered); and the totals: trajectories, multi-turn
    ones, `not rendered` and `multi-turn not rendered`, `differ` and `multi-turn differ`
    (trajectories), `multi-turn differ not only in whitespace` (every rendering differs at least by
    the newline after its final end-of-turn token), `multi-turn: <cause>` (multi-turn trajectories
    with a stretch of that cause) and `stretches: <cause>`."""
    by_trajectory: dict[str, list[dict]] = defaultdict(list)
    for call in calls:
        by_trajectory[call["trajectory_id"]].append(call)
    rows, totals = [], Counter()
    for tid, group in by_trajectory.items():
        multi = len(group) > 1
        totals["trajectories"] += 1
        totals["multi-turn"] += multi
        try:
            causes = Counter(trajectory_causes(group, tokenizer))
        except ValueError as e:
            rows.append({"trajectory_id": tid, "calls": len(group), "error": str(e)})
            totals["not rendered"] += 1
            totals["multi-turn not rendered"] += multi
            continue
        rows.append({"trajectory_id": tid, "calls": len(group), "causes": dict(causes)})
        totals["differ"] += bool(causes)
        totals["multi-turn differ"] += multi and bool(causes)
        totals["multi-turn differ not only in whitespace"] += multi and bool(set(causes) - {"whitespace"})
        for c, n in causes.items():
            totals[f"multi-turn: {c}"] += multi
            totals[f"stretches: {c}"] += n
    return rows, dict(totals)


def _covering(tokenizer: PreTrainedTokenizerBase, ids: list[int], start: int, end: int) -> range:
    """The fewest tokens of `ids` whose text covers characters [start, end) of the ids' text: by
    bisection over the lengths of the prefixes' texts."""
    length = lambda t: len(_text(tokenizer, ids[:t]))  # noqa: E731
    bounds = range(len(ids) + 1)
    return range(bisect_right(bounds, start, key=length) - 1, bisect_left(bounds, end, key=length))


def spellings(call: dict, tokenizer: PreTrainedTokenizerBase) -> dict:
    """Of one completion's sampled stretches, those whose decoded text re-encodes (`plain_ids`, as
    the rendering does) to other ids. The stretches are the runs of ids between control tokens (see
    `cause`), each tool call's arguments (the family's call format, `chat.tool_calls`; the fewest
    tokens covering them) a stretch of its own. Counts: `tool_calls`, `arguments` (calls whose
    arguments re-encode otherwise), `text` (other stretches that do)."""
    ids = list(call["completion_token_ids"])
    control = _control_ids(tokenizer)
    kind = ["control" if i in control else "text" for i in ids]
    text, fmt = _text(tokenizer, ids), tool_call_format(tokenizer)
    calls = fmt.parse(text).get("tool_calls", []) if fmt else []
    at = 0
    for n, tool_call in enumerate(calls):
        arguments = tool_call["function"]["arguments"]
        if (start := text.find(arguments, at)) >= 0:
            end = start + len(arguments)
        else:  # a call the parser re-serialized (other spacing): the call's whole text is its stretch
            if (start := text.find(fmt.call_start, at)) < 0:
                continue
            close = fmt.after_arguments.strip()
            end = text.find(close, start) + len(close) if close and close in text[start:] else len(text)
        at = end
        for t in _covering(tokenizer, ids, start, at):
            if kind[t] != "control":
                kind[t] = f"arguments {n}"
    pairs = groupby(zip(kind, ids, strict=True), key=lambda pair: pair[0])
    runs = [(k, [i for _, i in run]) for k, run in pairs if k != "control"]
    canonical = plain_ids(tokenizer, [_text(tokenizer, r) for _, r in runs])
    differ = [k for (k, r), c in zip(runs, canonical, strict=True) if r != c]
    return {
        "tool_calls": len(calls),
        "arguments": len({k for k in differ if k != "text"}),
        "text": differ.count("text"),
    }


def round_spellings(calls: Iterable[dict], tokenizer: PreTrainedTokenizerBase) -> dict:
    """`spellings` over `calls`: `completions`, `noncanonical completions` (a stretch re-encodes
    otherwise), `tool calls`, `noncanonical tool calls` (their arguments do)."""
    out = Counter()
    for call in calls:
        s = spellings(call, tokenizer)
        out["completions"] += 1
        out["noncanonical completions"] += bool(s["arguments"] or s["text"])
        out["tool calls"] += s["tool_calls"]
        out["noncanonical tool calls"] += s["arguments"]
    return dict(out)
