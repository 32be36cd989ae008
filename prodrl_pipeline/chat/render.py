"""A request's prompt ids from the model's own chat template, with client text kept text.

The prompt is `apply_chat_template`'s tokenization of the request, with one difference: a control
marker's string inside a client-provided string (contents, reasoning, tool names, arguments and
schemas, ids) is tokenized as the characters it is, so `<|im_start|>` typed by a user cannot open a
turn. Control markers (`control_markers`) are the tokenizer's special tokens and the added tokens
that look like markup and that the template writes (DeepSeek's `<｜User｜>`, Qwen3's `<tool_call>`
are not special tokens but open turns and calls), less those the template reads out of message text
(Qwen3's `<think>`/`</think>`, which its template splits reasoning at: they stay what the tokenizer
makes of them, as in `apply_chat_template`).

How, so that templates that transform text (`trim`, reasoning split off at `</think>`, tool schemas
read field by field) render exactly: each control marker's string in a client string, and any piece
of one at the string's ends (two strings or a string and the template's text could join into one),
is swapped for one private-use sentinel character that no template transforms; the real template
renders the escaped request; the rendered text is split at the control markers (all of them now
the template's own); each piece between them gets its sentinels back and is tokenized with every
control marker's string as plain text. Tokenizers split at added tokens before BPE, so this equals
`apply_chat_template` wherever no client string holds a control marker's string.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

# The Rust tokenizer encodes a batch on a thread pool unless told not to. A prompt here is a few
# short segments: the pool's hand-offs cost more than the encoding (render_ids 1.27 -> 0.80 ms a lab
# prompt, 2 cores, docs/performance.md). It also keeps forked workers (Dagster, torchrun) from
# inheriting a used pool. An explicit setting in the environment wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SENTINEL_BASE, SENTINEL_COUNT = 0xF0000, 0xFFFE  # Supplementary Private Use Area-A
SENTINEL = re.compile(f"[{chr(SENTINEL_BASE)}-{chr(SENTINEL_BASE + SENTINEL_COUNT - 1)}]")
MARKUP = re.compile(r"<[^\s<>]+>|\[[^\s\[\]]+\]")  # `<tool_call>`, `<｜User｜>`, `[INST]`: how a marker looks
PROBE = "probe"
PROBE_NAME, PROBE_ARGUMENTS = "probe_tool_name", '{"probe_argument": "probe value"}'


class TemplateError(ValueError):
    """The request cannot be rendered exactly by this model's template (a 400 naming why)."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved in HF format (the lab's or a production model's) with its rendering
    built (a large vocabulary's encoder copy takes ~1 s) or refused now: one without a chat template
    is refused unless it is gpt-oss's (`is_harmony`: harmony renders its chats)."""
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.chat_template is None and not is_harmony(tok):
        raise ValueError(f"{path}: tokenizer has no chat template (and is not gpt-oss's harmony tokenizer)")
    plain_ids(tok, [""])
    return tok


HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>")


def is_harmony(tokenizer: PreTrainedTokenizerBase) -> bool:
    """gpt-oss's tokenizer: no chat template, and harmony's special tokens (its chat format is
    harmony's, rendered by `chat.harmony`)."""
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return tokenizer.chat_template is None and set(HARMONY_MARKERS) <= special


def call_conversation(name: str, arguments: str | dict, content: str | None = None) -> list[dict]:
    """A user turn, an assistant turn holding one call `name(arguments)`, and the call's result."""
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "r"},
    ]


@lru_cache(maxsize=16)
def reads_argument_objects(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the template renders a call's arguments from a JSON object, as transformers' chat
    templates take them (Llama 3's `arguments | tojson`), and not from OpenAI's JSON string (which
    Qwen3's writes as it is): the probe's string is not in its rendering, its object's `tojson` is."""
    for content in (None, ""):  # DeepSeek's renders a call only beside null content, Qwen3's only beside text
        try:
            as_text = tokenizer.apply_chat_template(
                call_conversation(PROBE_NAME, PROBE_ARGUMENTS, content), tokenize=False
            )
            if PROBE_ARGUMENTS in as_text:
                return False
            objects = call_conversation(PROBE_NAME, json.loads(PROBE_ARGUMENTS), content)
            if PROBE_ARGUMENTS in tokenizer.apply_chat_template(objects, tokenize=False):
                return True
        except Exception:  # noqa: BLE001 - a template that refuses this content; the next one decides
            continue
    return False


def _argument_objects(messages: list[dict]) -> list[dict]:
    """History calls with their arguments as the JSON values their strings hold (TemplateError
    naming the call when one is not JSON: the template could only render it changed)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls and isinstance(calls, list):
            parsed = []
            for j, call in enumerate(calls):
                function = call.get("function") or {}
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        raise TemplateError(
                            f"messages.{i}.tool_calls.{j}.function.arguments is not JSON, and this model's "
                            "chat template renders arguments as a JSON object"
                        ) from None
                parsed.append({**call, "function": {**function, "arguments": arguments}})
            message = {**message, "tool_calls": parsed}
        out.append(message)
    return out


def _template_source(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template or ""
    return template if isinstance(template, str) else " ".join(template.values())  # named templates


@lru_cache(maxsize=16)
def control_markers(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The template's control markers, longest first: special tokens, and added tokens that look like
    markup and occur in the template's source, less those the template reads out of message text."""
    source = _template_source(tokenizer)
    added = tokenizer.added_tokens_decoder.values()
    candidates = {
        t.content for t in added if t.special or (MARKUP.fullmatch(t.content) and t.content in source)
    }
    in_source = sorted(m for m in candidates if m in source)
    read = {m for m in in_source if _template_reads(tokenizer, m, in_source)}
    return tuple(sorted(candidates - read, key=len, reverse=True))


def _template_reads(tokenizer: PreTrainedTokenizerBase, marker: str, others: list[str]) -> bool:
    """Whether the template's rendering of a conversation holding `marker` (beside the template's
    other markers: a split may need a pair) in every message depends on the marker itself (it splits,
    tests or strips at it): the rendering with the marker swapped for another character, and back,
    differs from the rendering with it."""
    stand_in = chr(SENTINEL_BASE)
    text = (
        "a"
        + "b".join([marker, *(m for m in others if m != marker), *(m for m in others if m != marker)])
        + "c"
    )
    for conversation in _probes(text):
        try:
            plain = tokenizer.apply_chat_template(conversation, tokenize=False)
            swapped = tokenizer.apply_chat_template(
                json.loads(json.dumps(conversation).replace(json.dumps(marker)[1:-1], stand_in)),
                tokenize=False,
            )
        except Exception:  # noqa: BLE001 - a template may refuse a probe's roles; the next probe decides
            continue
        if swapped.replace(stand_in, marker) != plain:
            return True
    return False


def _probes(text: str) -> list[list[dict]]:
    """Conversations with `text` in each role's content, in orders templates accept."""
    return [
        [{"role": "user", "content": text}, {"role": "assistant", "content": text}],
        [
            {"role": "system", "content": text},
            {"role": "user", "content": text},
            {"role": "assistant", "content": text},
            {"role": "user", "content": text},
        ],
    ]


@lru_cache(maxsize=16)
def _marker_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern:
    return re.compile("|".join(re.escape(m) for m in control_markers(tokenizer)) or "(?!)")


@lru_cache(maxsize=16)
def _escapes(tokenizer: PreTrainedTokenizerBase) -> tuple[re.Pattern, frozenset[str], frozenset[str]]:
    """What a client string has escaped: whole markers and sentinel characters anywhere (a pattern),
    a marker's proper suffix at the string's start and proper prefix at its end (two sets)."""
    markers = control_markers(tokenizer)
    whole = "|".join(re.escape(m) for m in markers)
    pattern = re.compile(f"{whole}|{SENTINEL.pattern}" if whole else SENTINEL.pattern)
    heads = frozenset(m[:k] for m in markers for k in range(1, len(m)))
    tails = frozenset(m[k:] for m in markers for k in range(1, len(m)))
    return pattern, heads, tails


@lru_cache(maxsize=16)
def _plain_encoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A private copy of the tokenizer's Rust backend that reads every control marker's string as
    plain text: the markers are special in the copy, and its special-token splitting is always on.
    Not `split_special_tokens=True`: that sets a flag on the backend the tokenizer shares, and another
    thread's call can reset it in between."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("rendering needs a fast (Rust-backed) tokenizer")
    config = json.loads(backend.to_str())
    control = set(control_markers(tokenizer))
    for token in config.get("added_tokens", []):
        token["special"] = token["special"] or token["content"] in control
    plain = Tokenizer.from_str(json.dumps(config))
    plain.no_truncation()
    plain.no_padding()
    plain.encode_special_tokens = True
    return plain


def plain_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, every control marker's string in it tokenized as the characters it is."""
    return [e.ids for e in _plain_encoder(tokenizer).encode_batch(texts, add_special_tokens=False)]


def _nothing_dropped(text: str, messages: list[dict], tools: list | None) -> None:
    """TemplateError unless every tool's name and every history tool call's name and arguments occur
    in the rendering as often as the request holds them (a template that cannot render tools, or
    renders a call only when content is null, would drop them without a word)."""
    wanted: dict[str, int] = {}
    for i, tool in enumerate(tools or []):
        name = (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None
        if isinstance(name, str) and name:
            wanted[name] = wanted.get(name, 0) + 1
        elif tools:
            raise TemplateError(f"tools.{i} has no function name")
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, dict) and arguments:  # rendered by `tojson`
                arguments = json.dumps(arguments, ensure_ascii=False)
            for value in (function.get("name"), arguments):
                if isinstance(value, str) and value:
                    wanted[value] = wanted.get(value, 0) + 1
    for value, count in wanted.items():
        if text.count(value) < count:
            raise TemplateError(
                "this model's chat template does not render the request's tools or tool calls "
                f"(it drops {value[:64]!r}); send them in a form it renders, or without them"
            )


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs,
) -> list[int]:
    """Token ids of the chat template over `messages` and `tools` (by default the prompt of the next
    assistant turn), every client string's control-marker text kept text (module docstring). A null
    content the template cannot take (Qwen3's tests it as a string) is rendered as "", what it renders
    for a turn without text. Raises TemplateError when the template drops a tool or a history tool
    call (`_nothing_dropped`), or a request holds more escaped strings than there are sentinels. A
    template that renders call arguments only from objects (`reads_argument_objects`) gets each
    string parsed (vLLM parses them for every template); one that writes a string as it is gets the
    client's string."""
    if reads_argument_objects(tokenizer):
        messages = _argument_objects(messages)
    pattern, heads, tails = _escapes(tokenizer)
    longest = max(map(len, heads), default=0)
    held: list[str] = []

    def hold(piece: str) -> str:
        if len(held) == SENTINEL_COUNT:
            raise TemplateError(f"the request holds more than {SENTINEL_COUNT} control-marker strings")
        held.append(piece)
        return chr(SENTINEL_BASE + len(held) - 1)

    def escape_text(text: str) -> str:
        """Whole markers held; then a marker's piece at either end, whitespace around it left as text
        (a template may trim it)."""
        text = pattern.sub(lambda m: hold(m.group()), text)
        core = text.strip()
        start = len(text) - len(text.lstrip())
        end = start + len(core)
        head = next((k for k in range(min(longest, len(core)), 0, -1) if core[-k:] in heads), 0)
        tail = next((k for k in range(min(longest, len(core) - head), 0, -1) if core[:k] in tails), 0)
        if not head and not tail:
            return text
        middle = core[tail : len(core) - head]
        return (
            text[:start]
            + (hold(core[:tail]) if tail else "")
            + middle
            + (hold(core[len(core) - head :]) if head else "")
            + text[end:]
        )

    def escape(value):  # noqa: ANN001, ANN202
        if isinstance(value, str):
            return escape_text(value)
        if isinstance(value, dict):
            return {escape(k): escape(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [escape(v) for v in value]
        return value

    escaped_messages, escaped_tools = escape(messages), escape(tools) if tools else tools

    def template(conversation: list[dict]) -> str:
        return tokenizer.apply_chat_template(
            conversation,
            tools=escaped_tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    try:
        text = template(escaped_messages)
    except Exception:  # noqa: BLE001 - the template's own error, or null content it cannot take
        if not any(m.get("content") is None for m in escaped_messages):
            raise
        text = template(
            [{**m, "content": "" if m.get("content") is None else m["content"]} for m in escaped_messages]
        )
    _nothing_dropped(text, escaped_messages, escaped_tools)
    markers, pieces, start = [], [], 0
    for match in _marker_pattern(tokenizer).finditer(text):
        pieces.append(text[start : match.start()])
        markers.append(tokenizer.convert_tokens_to_ids(match.group()))
        start = match.end()
    pieces.append(text[start:])
    restore = lambda piece: SENTINEL.sub(lambda m: held[ord(m.group()) - SENTINEL_BASE], piece)  # noqa: E731
    ids: list[int] = []
    for i, piece_ids in enumerate(plain_ids(tokenizer, [restore(p) for p in pieces])):
        ids += piece_ids
        if i < len(markers):
            ids.append(markers[i])
    return ids
