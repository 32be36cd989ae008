"""Tokenizer and chat template: a small byte-level BPE trained locally, one token per move string.

The chat template renders system/user/assistant/tool turns with ChatML-style special tokens and
tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an assistant turn ends
with `<|im_end|>`, the engine's stop token. Move strings are added tokens (`single_word`), so a
move in the legal-move list and the same move as a tool argument are the same token id.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE]
# The Rust tokenizer encodes a batch on a thread pool unless told not to. A prompt here is a few
# short segments: the pool's hand-offs cost more than the encoding (render_ids 1.27 -> 0.80 ms a lab
# prompt, 2 cores, docs/performance.md). It also keeps forked workers (Dagster, torchrun) from
# inheriting a used pool. An explicit setting in the environment wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
PLACEHOLDER = re.compile("\ue000([0-9a-f]{16}):([0-9]+)\ue001")  # render_ids' stand-in: nonce, index
MARKUP = re.compile(r"<[^\s<>]+>|\[[^\s\[\]]+\]")  # `<tool_call>`, `[INST]`: how a marker looks

CHAT_TEMPLATE = (
    # No whitespace control: every newline below is part of the rendering.
    "{% if tools and messages[0].role != 'system' %}"
    "<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "<|im_start|>system\n{{ m.content }}"
    "{% if tools %}\n\n# Tools\n<tools>{{ tools | tojson }}</tools>{% endif %}"
    "<|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": '
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str], move_strings: Iterable[str], vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`, then add one token per move string."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(m, single_word=True, normalized=False) for m in sorted(set(move_strings))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START, TOOL_CALL_OPEN, TOOL_CALL_CLOSE],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved in HF format (ours or a production model's)."""
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.chat_template is None:
        raise ValueError(f"{path}: tokenizer has no chat template")
    _plain_encoder(tok)  # built now (a large vocabulary's copy takes ~1 s), refused now if it cannot be
    return tok


def _held_tool_call(call: dict, hold_all) -> dict:  # noqa: ANN001
    """A tool call's id, name and arguments held: a string verbatim, an object as the template's
    `tojson` will write its strings."""
    function = call["function"]
    args = function.get("arguments")
    held = {
        **function,
        "name": hold_all(function.get("name"), False),
        "arguments": hold_all(args, not isinstance(args, str)),
    }
    return {**call, "function": held} | ({"id": hold_all(call["id"], False)} if "id" in call else {})


@lru_cache(maxsize=8)
def _control_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The added tokens that are the chat template's control markers, longest first: the special
    ones, and any other that looks like markup (`MARKUP`) and that the template's text holds (a
    production tokenizer may register markers such as `<tool_call>` as ordinary added tokens: they
    still open a tool call). Not any added token the template holds: a run of spaces, or a word the
    template happens to write, is text, and splitting it would change benign prompts."""
    template = tokenizer.chat_template or ""
    template = template if isinstance(template, str) else " ".join(template.values())  # named templates
    added = tokenizer.added_tokens_decoder.values()
    control = [
        t.content for t in added if t.special or (MARKUP.fullmatch(t.content) and t.content in template)
    ]
    return tuple(sorted(control, key=len, reverse=True))


@lru_cache(maxsize=8)
def _plain_encoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A private copy of the tokenizer's Rust backend that reads every control token's string as
    plain text, for this module's callers alone: the control tokens are special in the copy and its
    special-token splitting is always on. Not `split_special_tokens=True`: that sets the flag on the
    backend the tokenizer shares, before each call, and another thread's call (the gateway's
    /v1/completions encode) can reset it in between: with a 1 µs thread switch interval, 53 of
    5,000 renders of a message holding `<|im_start|>` got a control token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("rendering needs a fast (Rust-backed) tokenizer")
    config = json.loads(backend.to_str())
    control = set(_control_tokens(tokenizer))
    for token in config.get("added_tokens", []):
        token["special"] = token["special"] or token["content"] in control
    plain = Tokenizer.from_str(json.dumps(config))
    plain.no_truncation()
    plain.no_padding()
    plain.encode_special_tokens = True
    return plain


def plain_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, every control token's string in it tokenized as the characters it is."""
    return [e.ids for e in _plain_encoder(tokenizer).encode_batch(texts, add_special_tokens=False)]


@lru_cache(maxsize=8)
def _markers(tokenizer: PreTrainedTokenizerBase) -> re.Pattern:
    """A regex of the template's control markers (`_control_tokens`), longest first."""
    return re.compile("|".join(re.escape(t) for t in _control_tokens(tokenizer)) or "(?!)")  # none: no match


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the chat template over `messages` (by default: the prompt of the next assistant
    turn). Only the template's own markers become special tokens: every string that came with the
    messages or tools (contents, tool-call names and arguments, tool schemas) is tokenized as plain
    text, so `<|im_start|>` typed by a user stays the characters it is and cannot open a turn.

    How: each such string is swapped for a per-call nonce placeholder before rendering, so every
    marker in the rendered text is the template's; the text between those markers, with the strings
    put back, is tokenized with every marker's string split into ordinary tokens. Without a marker's
    string in the messages this is exactly the plain rendering's tokenization, for templates that
    insert strings as they are: the text with the strings put back must equal the plain rendering,
    else ValueError (a template that trims, splits, escapes or tests a string). Dict keys (tool
    schemas, argument objects) are written raw by `tojson`, so a key holding a marker is refused.
    Tool-call ids are held too: a template may render them."""
    marker = _markers(tokenizer)
    nonce = secrets.token_hex(8)
    held: list[str] = []

    def hold(text: str, json_escaped: bool = False) -> str:
        held.append(json.dumps(text, ensure_ascii=False)[1:-1] if json_escaped else text)
        return f"\ue000{nonce}:{len(held) - 1}\ue001"

    def hold_all(value, json_escaped: bool):  # noqa: ANN001, ANN202
        if isinstance(value, str):
            return hold(value, json_escaped) if value else value
        if isinstance(value, dict):  # keys are written raw by `tojson`: they may not carry markers
            if any(isinstance(k, str) and marker.search(k) for k in value):
                raise ValueError("a key in the tools or tool-call arguments contains a special token")
            return {k: hold_all(v, json_escaped) for k, v in value.items()}
        if isinstance(value, list):
            return [hold_all(v, json_escaped) for v in value]
        return value

    masked = []
    for m in messages:
        m = dict(m)
        for key in ("content", "tool_call_id"):  # ids too: a template may render them
            if isinstance(m.get(key), str):
                m[key] = hold_all(m[key], False)
        if m.get("tool_calls"):
            m["tool_calls"] = [_held_tool_call(tc, hold_all) for tc in m["tool_calls"]]
        masked.append(m)
    text = tokenizer.apply_chat_template(
        masked,
        tools=hold_all(tools, True) if tools else tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    restored = PLACEHOLDER.sub(lambda m: held[int(m.group(2))] if m.group(1) == nonce else m.group(), text)
    plain = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if restored != plain:  # the template reads or changes a string (trims, splits, escapes, tests it)
        raise ValueError("the chat template transforms message text; render_ids cannot keep it plain")
    # Markers are looked for in the template's own text alone, never inside a placeholder (a
    # marker string may occur in a nonce); each placeholder becomes its string, as plain text.
    segments, markers, run, pos = [], [], [], 0

    def template_text(part: str) -> None:
        start = 0
        for match in marker.finditer(part):
            segments.append("".join([*run, part[start : match.start()]]))
            run.clear()
            markers.append(tokenizer.convert_tokens_to_ids(match.group()))
            start = match.end()
        run.append(part[start:])

    for placeholder in PLACEHOLDER.finditer(text):
        if placeholder.group(1) == nonce:
            template_text(text[pos : placeholder.start()])
            run.append(held[int(placeholder.group(2))])
            pos = placeholder.end()
    template_text(text[pos:])
    segments.append("".join(run))
    encoded = plain_ids(tokenizer, segments)  # the text between markers, each segment on its own
    ids = []
    for i, segment_ids in enumerate(encoded):
        ids += segment_ids
        if i < len(markers):
            ids.append(markers[i])
    return ids


def tool_call_prefix(tool_name: str) -> str:
    """The text the template renders before a tool call's argument object's first value."""
    return f'{TOOL_CALL_OPEN}{{"name": "{tool_name}", "arguments": '


def parse_assistant_text(text: str, call_id_prefix: str = "call") -> dict:
    """An OpenAI-style assistant message from completion text: content plus any tool calls
    (ids `<call_id_prefix>_<i>`). A tool call whose JSON does not parse keeps its raw text as arguments."""
    text = text.removesuffix(IM_END)
    content, calls = text, []
    while TOOL_CALL_OPEN in content and TOOL_CALL_CLOSE in content:
        head, _, rest = content.partition(TOOL_CALL_OPEN)
        body, _, tail = rest.partition(TOOL_CALL_CLOSE)
        content = head + tail
        try:
            obj = json.loads(body)
            name, args = obj["name"], json.dumps(obj.get("arguments", {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            name, args = "", body
        calls.append(
            {
                "id": f"{call_id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message
