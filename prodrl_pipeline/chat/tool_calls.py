"""A model family's tool-call format, read off its own chat template.

The template renders an assistant turn holding one probe call (a probe name, probe arguments), after
a user turn and before the tool's result; the text around the name and the arguments is the format:
Qwen3's `<tool_call>\\n{"name": "` ... `", "arguments": ` ... `}\\n</tool_call>`, DeepSeek's tool
tokens, the lab's own. A forced call's completion ids are the template's rendering of that turn
(so a client re-sending the call as history extends the prompt it was served with), and a
completion's text is parsed back with the same pieces. A template that renders no tool definitions,
or whose call cannot be read off (the turn's rendering is not an extension of the generation prompt,
the probe is not found, no end-of-turn follows it), has no format: tools are refused by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import (
    PROBE_ARGUMENTS,
    PROBE_NAME,
    TemplateError,
    call_conversation,
    control_markers,
    reads_argument_objects,
    render_ids,
)

PROBE_CONTENT = "probe content"
MAX_NAME = 64  # OpenAI's longest function name
_DECODER = json.JSONDecoder()
PROBE_TOOL = {
    "type": "function",
    "function": {"name": PROBE_NAME, "description": "d", "parameters": {"type": "object", "properties": {}}},
}


def _conversation(
    tokenizer: PreTrainedTokenizerBase, name: str, arguments: str, content: str | None = None
) -> list[dict]:
    """`call_conversation` with the arguments in the form the template reads (an object or a string)."""
    return call_conversation(
        name, json.loads(arguments) if reads_argument_objects(tokenizer) else arguments, content
    )


@lru_cache(maxsize=16)
def _call_content(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The content a call-only assistant turn renders with: null (OpenAI's), or "" for a template
    that cannot take null (Qwen3's tests `'</think>' in content`)."""
    try:
        tokenizer.apply_chat_template(_conversation(tokenizer, PROBE_NAME, PROBE_ARGUMENTS), tokenize=False)
        return None
    except Exception:  # noqa: BLE001 - the template's own error: it needs a string
        return ""


@dataclass(frozen=True)
class ToolCallFormat:
    """The text a call's name and arguments sit between, up to the end of the assistant's turn."""

    before_name: str
    between: str
    after_arguments: str
    """Up to, not including, the end-of-turn token."""
    open_marker: str | None
    """The control marker a call starts with (streaming holds text back from it), if any."""
    separator: str = ""
    """What the template writes between a turn's text and a call (Qwen3: a newline): parsed
    content gives it back, so the turn re-sent as history renders as it was generated."""

    @property
    def call_start(self) -> str:
        """The text a call starts with: its control marker, else the text before its name."""
        return self.open_marker or self.before_name

    def parse(self, text: str, call_id_prefix: str = "call") -> dict:
        """An OpenAI assistant message from completion text (the end-of-turn token left out): the text
        outside calls as content, each call's name and arguments (a JSON string). A call opened by a
        control marker that does not match the format keeps its raw text as arguments, with an empty
        name; without a marker (Llama 3's bare JSON), text that does not match stays content."""
        calls, content, pos, start = [], [], 0, self.call_start
        while (i := text.find(start, pos)) >= 0:
            stop, call = self._call(text, i, f"{call_id_prefix}_{len(calls)}")
            if call is None:
                content.append(text[pos:stop])
            else:
                content.append(text[pos:i].removesuffix(self.separator) if self.separator else text[pos:i])
                calls.append(call)
            pos = stop
        content.append(text[pos:])
        message: dict = {"role": "assistant", "content": "".join(content)}
        if calls:
            message["tool_calls"] = calls
        return message

    def _call(self, text: str, i: int, call_id: str) -> tuple[int, dict | None]:
        """The call starting at `i` and where it ends. With a marker it runs to the first closing
        text; one that does not match the format keeps its raw text (after `_json_call` tried other
        spacing). Without one, `_bare_call`."""
        opened = i + len(self.call_start)
        if self.open_marker is None:
            return self._bare_call(text, opened, call_id)
        end = self.after_arguments.strip()
        j = text.find(end, opened) if end else -1
        stop = j + len(end) if j >= 0 else len(text)
        if match := self._pattern.fullmatch(text, i, stop):
            return stop, _message_call(call_id, match["name"], match["arguments"])
        raw = text[i:stop]
        name, arguments = _json_call(raw.removeprefix(self.open_marker), self) or ("", raw)
        return stop, _message_call(call_id, name, arguments)

    def _bare_call(self, text: str, opened: int, call_id: str) -> tuple[int, dict | None]:
        """A call with no marker (Llama 3's `{"name": ..., "parameters": {...}}`): a name of at most
        MAX_NAME characters, the format's text, arguments that are one whole JSON value (read by the
        JSON decoder, so a nested `}` stays inside and the work is linear), then the closing text.
        Anything else is no call: (where to look on, None)."""
        j = text.find(self.between, opened, opened + MAX_NAME + len(self.between))
        start = j + len(self.between)
        if j <= opened or any(c in text[opened:j] for c in '"\\\n'):
            return opened, None
        try:
            _, end = _DECODER.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):
            return opened, None
        close = self.after_arguments.strip()
        if not text.startswith(close, end):
            return opened, None
        return end + len(close), _message_call(call_id, text[opened:j], text[start:end])

    @property
    def _pattern(self) -> re.Pattern:
        return _call_pattern(self.before_name, self.between, self.after_arguments)


@lru_cache(maxsize=64)
def _call_pattern(before_name: str, between: str, after_arguments: str) -> re.Pattern:
    body = re.escape(before_name.strip()) + r"(?P<name>.*?)" + re.escape(between)
    body += r"(?P<arguments>.*)" + re.escape(after_arguments.strip())
    return re.compile(r"\s*" + body + r"\s*", flags=re.S)


def _message_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_call(raw: str, fmt: ToolCallFormat) -> tuple[str, str] | None:
    """A JSON-object call (`{"name": ..., "arguments": {...}}`) with other spacing than the template's."""
    closing = fmt.after_arguments.strip().lstrip("}").strip()
    body = raw.strip().removesuffix(closing).strip() if closing else raw.strip()
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: brackets nested past the limit
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        return obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)
    return None


@lru_cache(maxsize=16)
def tool_call_format(tokenizer: PreTrainedTokenizerBase) -> ToolCallFormat | None:
    """The format read off the template (module docstring), None if it has none."""
    try:
        with_tools = tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}], tools=[PROBE_TOOL], tokenize=False
        )
        if PROBE_NAME not in with_tools:
            return None  # the template drops tool definitions
        prompt = tokenizer.apply_chat_template(
            _conversation(tokenizer, PROBE_NAME, PROBE_ARGUMENTS)[:1],
            tokenize=False,
            add_generation_prompt=True,
        )
        full = tokenizer.apply_chat_template(
            _conversation(tokenizer, PROBE_NAME, PROBE_ARGUMENTS, _call_content(tokenizer)), tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that refuses the probe has no format
        return None
    eos = tokenizer.eos_token
    if not full.startswith(prompt) or not eos:
        return None
    turn = full[len(prompt) :]
    name_at, arguments_at, end_at = turn.find(PROBE_NAME), turn.find(PROBE_ARGUMENTS), turn.find(eos)
    if not 0 <= name_at < arguments_at < end_at:
        return None
    before = turn[:name_at]
    opening = next((m for m in control_markers(tokenizer) if before.lstrip().startswith(m)), None)
    return ToolCallFormat(
        before_name=before,
        between=turn[name_at + len(PROBE_NAME) : arguments_at],
        after_arguments=turn[arguments_at + len(PROBE_ARGUMENTS) : end_at],
        open_marker=opening,
        separator=_separator(tokenizer, prompt, before),
    )


def _separator(tokenizer: PreTrainedTokenizerBase, prompt: str, before_name: str) -> str:
    """The text between a turn's content and its call ("" if the template takes no content beside
    a call, or puts something else between)."""
    try:
        turn = tokenizer.apply_chat_template(
            _conversation(tokenizer, PROBE_NAME, PROBE_ARGUMENTS, PROBE_CONTENT), tokenize=False
        )[len(prompt) :]
    except Exception:  # noqa: BLE001 - a template that cannot take both
        return ""
    start, end = turn.find(PROBE_CONTENT), turn.find(before_name)
    gap = turn[start + len(PROBE_CONTENT) : end] if 0 <= start < end else ""
    return gap if gap.strip() == "" else ""


@lru_cache(maxsize=16)
def _probe_prompt(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return render_ids(tokenizer, _conversation(tokenizer, PROBE_NAME, PROBE_ARGUMENTS)[:1])


def call_ids(tokenizer: PreTrainedTokenizerBase, name: str, arguments: str) -> tuple[int, ...]:
    """The completion ids of one call `name(arguments)` ending the assistant's turn, as the template
    renders that turn in history. TemplateError if the family has no format."""
    if tool_call_format(tokenizer) is None:
        raise TemplateError("this model's chat template has no tool-call format: tools cannot be served")
    conversation = call_conversation(name, arguments, _call_content(tokenizer))
    prompt = _probe_prompt(tokenizer)
    full = render_ids(tokenizer, conversation, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise TemplateError("the template's tool-call turn does not extend its generation prompt")
    completion = full[len(prompt) :]
    end = completion.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in completion else -1
    if end < 0:
        raise TemplateError("the template's tool-call turn has no end-of-turn token")
    return tuple(completion[: end + 1])
