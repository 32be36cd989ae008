"""How the gateway renders a chat request and reads the reply, chosen once at start-up from the
served tokenizer: the model's own HF chat template (`TemplateChat`: `chat.render`, `chat.tool_calls`),
or harmony for gpt-oss (`chat.harmony.HarmonyChat`: a tokenizer with harmony's special tokens and no
chat template). Both give `prompt_ids(messages, tools)`, `reply(completion, ...)` (the assistant
message), `forced_call(tools, name)` (a required call's constraint) and `stop_ids` (what ends a
reply besides the engine's eos)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.harmony import HarmonyChat
from prodrl_pipeline.chat.render import is_harmony, render_ids
from prodrl_pipeline.chat.tool_calls import tool_call_format
from prodrl_pipeline.engine.rows import Completion
from prodrl_pipeline.envs.tool_choice import required_tool_call
from prodrl_pipeline.gateway.responses import cut_at_stop, text_of


class TemplateChat:
    """The model's HF chat template: prompts by `render_ids`, calls in the template's own format."""

    serves_json = True
    stop_ids: frozenset[int] = frozenset()  # the engine's eos ends the turn

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.calls = tool_call_format(tokenizer)
        self.serves_tools = self.calls is not None

    def stream_hold(self, parse_calls: bool) -> tuple[str, ...]:
        """The texts a streamed reply is held back from: where the family's calls start, with the
        separator that parsed content drops before one (what is shown stays a prefix of it)."""
        if not (parse_calls and self.calls):
            return ()
        start, separator = self.calls.call_start, self.calls.separator
        return (separator + start, start) if separator else (start,)

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        return render_ids(self.tokenizer, messages, tools=tools)

    def forced_call(self, tools: Sequence[dict], name: str | None):  # noqa: ANN201 - a ChoiceConstraint
        return required_tool_call(self.tokenizer, tools, name)

    def reply(self, c: Completion, stops: list[str] | None, parse_calls: bool, call_id_prefix: str) -> dict:
        text = text_of(self.tokenizer, c)
        text = cut_at_stop(text, stops) if c.finish_reason == "stop" else text
        if not parse_calls:  # the text as it is, tool-call markup included
            return {"role": "assistant", "content": text}
        return self.calls.parse(text, call_id_prefix=call_id_prefix)


class HarmonyReply(HarmonyChat):
    """harmony's chat format with the gateway's reply: stop strings cut the final text."""

    def reply(self, c: Completion, stops: list[str] | None, parse_calls: bool, call_id_prefix: str) -> dict:
        message = self.message(c.token_ids, parse_calls, call_id_prefix)
        if c.finish_reason == "stop" and stops:
            message["content"] = cut_at_stop(message["content"], stops)
        return message


def chat_format(tokenizer: PreTrainedTokenizerBase) -> TemplateChat | HarmonyReply:
    """The served tokenizer's chat format (module docstring)."""
    return HarmonyReply(tokenizer) if is_harmony(tokenizer) else TemplateChat(tokenizer)
