"""gpt-oss's chat format: OpenAI's harmony, rendered and parsed by `openai-harmony` (as vLLM does for
these models), never by a hand-written renderer.

The encoding is loaded offline: harmony reads `o200k_base.tiktoken` from TIKTOKEN_ENCODINGS_BASE (it
would download it otherwise). That file is generated once from the served tokenizer's own
`tokenizer.json` (its vocabulary is o200k_base's, ranks = ids) into PRODRL_HARMONY_CACHE (default
~/.cache/prodrl/harmony), checked against OpenAI's sha256, and the encoding is loaded once a process.

A request becomes harmony messages as vLLM maps Chat Completions:
- a system message (harmony's model identity, reasoning effort medium, and a FIXED conversation start
  date, START_DATE, not today's: the same request renders the same prompt any day);
- a developer message with the instructions of a leading system/developer message and the function
  tools (a later system/developer message becomes a developer message of its own);
- user text; an assistant turn's reasoning (`reasoning_content`/`reasoning`) on the analysis channel,
  its content on the final channel (with tool calls: on the commentary channel, as a preamble), each
  tool call on the commentary channel to `functions.NAME` with content type `json`;
- a tool result from `functions.NAME` (NAME looked up from its tool_call_id) to the assistant;
- reasoning before the last final answer (earlier turns') is dropped, as vLLM does; the reasoning
  of the turn in progress (analysis, tool calls, results with no final yet) is kept.
Message text is encoded as text (harmony's `encode_ordinary`): a user's `<|start|>` is characters.

A completion (ids after the prompt's `<|start|>assistant`) is parsed back: final text as content,
analysis as `reasoning_content`, messages to `functions.*` as tool calls; output harmony cannot parse
is kept as its decoded text. Generation stops at <|return|> and <|call|>. A forced call is
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` + the JSON arguments + <|call|>.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    RenderConversationConfig,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import TemplateError
from prodrl_pipeline.envs.tool_choice import required_tool_call

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # harmony's pin
START_DATE = "2025-01-01"
"""The conversation start date every prompt names (vLLM uses today's unless VLLM_SYSTEM_START_DATE)."""
CALL_HEADER = "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"

_lock = threading.Lock()
_encoding: HarmonyEncoding | None = None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map, which byte-level BPE vocabularies spell tokens in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def vocab_file(tokenizer: PreTrainedTokenizerBase, folder: Path) -> Path:
    """`folder/o200k_base.tiktoken` from the tokenizer's BPE vocabulary (written once, atomically);
    ValueError unless its sha256 is OpenAI's (harmony refuses any other file)."""
    path = folder / VOCAB_FILE
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256:
        return path
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["vocab"]
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    data = b"".join(
        base64.b64encode(bytes(decode[ch] for ch in token)) + b" " + str(rank).encode() + b"\n"
        for token, rank in items
    )
    if [r for _, r in items] != list(range(len(items))) or hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        raise ValueError("the tokenizer's vocabulary is not o200k_base: harmony cannot render for it")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{VOCAB_FILE}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def encoding(tokenizer: PreTrainedTokenizerBase) -> HarmonyEncoding:
    """harmony's gpt-oss encoding, loaded once a process, offline (module docstring)."""
    global _encoding  # noqa: PLW0603 - one encoding a process, as vLLM's get_encoding()
    with _lock:
        if _encoding is None:
            default = Path.home() / ".cache" / "prodrl" / "harmony"
            folder = vocab_file(tokenizer, Path(os.environ.get("PRODRL_HARMONY_CACHE", default))).parent
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)  # harmony reads it at load time
            _encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        return _encoding


def _text(content: object) -> str:
    return content if isinstance(content, str) else ""


def harmony_messages(messages: list[dict], tools: list | None = None) -> list[Message]:
    """A request's messages (`ChatMessage.for_template()` dicts) and tools as harmony messages
    (module docstring). TemplateError for a tool result whose tool_call_id no earlier call has."""
    system = SystemContent.new().with_conversation_start_date(START_DATE)
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    rest = list(messages)
    instructions = _text(rest.pop(0).get("content")) if rest and rest[0]["role"] == "system" else None
    functions = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TemplateError(f"tools.{i} has no function name")
        described = function.get("description") or ""
        functions.append(
            ToolDescription.new(function["name"], described, parameters=function.get("parameters"))
        )
    if instructions is not None or functions:
        developer = DeveloperContent.new()
        developer = developer.with_instructions(instructions) if instructions else developer
        developer = developer.with_function_tools(functions) if functions else developer
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names: dict[str, str] = {}
    for m in rest:
        role, content = m["role"], _text(m.get("content"))
        if role == "system":
            out.append(
                Message.from_role_and_content(
                    Role.DEVELOPER, DeveloperContent.new().with_instructions(content)
                )
            )
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            if reasoning := m.get("reasoning_content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            calls = m.get("tool_calls") or []
            if content:
                channel = "commentary" if calls else "final"
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel))
            for call in calls:
                function = call["function"]
                arguments = function.get("arguments", "")
                arguments = (
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                )
                if call.get("id"):
                    names[call["id"]] = function["name"]
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, arguments)
                    .with_channel("commentary")
                    .with_recipient(f"functions.{function['name']}")
                    .with_content_type("json")
                )
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "")
            if name is None:
                raise TemplateError(f"tool result {m.get('tool_call_id')!r} answers no earlier tool call")
            author = Author.new(Role.TOOL, f"functions.{name}")
            out.append(
                Message.from_author_and_content(author, content)
                .with_channel("commentary")
                .with_recipient("assistant")
            )
    return _drop_earlier_reasoning(out)


def _drop_earlier_reasoning(messages: list[Message]) -> list[Message]:
    """Every analysis message before the last final one goes (vLLM's auto_drop_analysis_messages)."""
    finals = [i for i, m in enumerate(messages) if m.author.role == Role.ASSISTANT and m.channel == "final"]
    if not finals:
        return messages
    return [m for i, m in enumerate(messages) if i > finals[-1] or m.channel != "analysis"]


class HarmonyChat:
    """The gateway's chat format for gpt-oss (module docstring); `TemplateChat` is the other one."""

    serves_tools = True
    serves_json = False  # a JSON reply would have to start after a final-channel header: not yet

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer, self.enc = tokenizer, encoding(tokenizer)
        self.stop_ids = frozenset(self.enc.stop_tokens_for_assistant_actions())  # <|return|>, <|call|>

    def stream_hold(self, parse_calls: bool) -> tuple[str, ...]:  # noqa: ARG002
        """Streamed text is held from the first <|channel|>: the parsed message is sent whole."""
        return ("<|channel|>",)

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        conversation = Conversation.from_messages(harmony_messages(messages, tools))
        config = RenderConversationConfig(auto_drop_analysis=False)  # dropped already, as vLLM
        return list(self.enc.render_conversation_for_completion(conversation, Role.ASSISTANT, config))

    def call_ids(self, name: str, arguments: str) -> tuple[int, ...]:
        """The completion ids of one call `name(arguments)`, as gpt-oss emits it, ending at <|call|>."""
        header = self.enc.encode(CALL_HEADER.format(name=name), allowed_special="all")
        body = self.enc.encode(arguments, disallowed_special=())
        return (*header, *body, self.tokenizer.convert_tokens_to_ids("<|call|>"))

    def forced_call(self, tools: Sequence[dict], name: str | None):  # noqa: ANN201 - a ChoiceConstraint
        return required_tool_call(self.tokenizer, tools, name, render=self.call_ids)

    def message(self, ids: list[int], parse_calls: bool = True, call_id_prefix: str = "call") -> dict:
        """The OpenAI assistant message of completion ids: final (and recipient-less commentary) text
        as content, analysis as `reasoning_content`, calls to functions.* as tool calls; output
        harmony cannot parse is its decoded text as content (never an error)."""
        shown = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        try:
            parsed = self.enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
        except Exception:  # noqa: BLE001 - malformed output is the model's reply, kept as text
            return {"role": "assistant", "content": self.tokenizer.decode(shown, skip_special_tokens=False)}
        content, reasoning, calls = [], [], []
        for m in parsed:
            text = "".join(getattr(c, "text", "") for c in m.content)
            recipient = m.recipient or ""
            if parse_calls and recipient.startswith("functions."):
                function = {"name": recipient.removeprefix("functions."), "arguments": text}
                calls.append(
                    {"id": f"{call_id_prefix}_{len(calls)}", "type": "function", "function": function}
                )
            elif m.channel == "analysis":
                reasoning.append(text)
            else:
                content.append(text)
        message: dict = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        return message
