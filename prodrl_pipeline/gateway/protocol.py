"""The OpenAI request schemas the gateway accepts, strictly: every parameter is honoured or refused.

Types are strict (`"2"` is not an integer, `true` is not a number); a field the schema does not
know is refused by name, as OpenAI does; a known OpenAI parameter the gateway cannot honour
exactly is accepted only at its neutral value (`presence_penalty: 0`, `n: 1`, ...) and refused
otherwise. A refusal is a 400 whose `error.param` names the field (docs/gateway.md lists them all).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP, MAX_STOP_CHARS = 4, 128  # stop sequences: OpenAI's count; a length bound on their check
MAX_LOGIT_BIAS = 300  # tokens per call: a bound on what each recorded call carries
MIN_TEMPERATURE = 0.01  # below (except 0, greedy) logits / T overflow into NaN
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits on `metadata`


class ParamError(ValueError):
    """A request refused because of one parameter (a 400 naming it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _utf8(value: Any, where: str) -> Any:
    """Refuse strings a UTF-8 encoder cannot write (lone surrogates arrive through JSON escapes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} is not valid UTF-8 text (a lone surrogate)") from e
    elif isinstance(value, dict):
        for k, v in value.items():
            _utf8(k, where)
            _utf8(v, where)
    elif isinstance(value, list):
        for v in value:
            _utf8(v, where)
    return value


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _neutral(value: object, neutral: object, why: str) -> object:
    if value is not None and value != neutral:
        raise ValueError(f"{value!r} is not supported ({why}); leave it unset or {neutral!r}")
    return value


class StreamOptions(Strict):
    include_usage: bool = False
    """A last chunk (no choices) carries the call's usage."""


class SamplingFields(Strict):
    """Parameters shared by chat and completions (`top_k` is vLLM's extension)."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=2**31 - 1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per call: each call is one recorded sample")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Any string (OpenAI sets no length limit; the body limit bounds it); a trajectory id."""
    metadata: dict[str, str] | None = None
    # OpenAI parameters honoured only at their neutral value: each would change mu in a way the
    # recorded columns cannot express (penalties reshape it) or is not one recorded sample
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (
            len(stops) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops)
        ):
            raise ValueError(f"stop takes at most {MAX_STOP} strings of 1-{MAX_STOP_CHARS} characters")
        return _utf8(stops, "stop")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's shape: token ids as decimal strings, biases in [-100, 100] (recorded per call)."""
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in v.items():
            if not (token.isascii() and token.isdigit() and len(token) <= 10):
                raise ValueError(f"logit_bias keys are token ids, got {token[:20]!r}")
            if not -100 <= bias <= 100:  # NaN fails too
                raise ValueError(f"logit_bias values are in [-100, 100], got {bias}")
        if len({int(t) for t in v}) < len(v):  # "7" and "007": which would win is anyone's guess
            raise ValueError("logit_bias names a token id twice")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v

    @field_validator("model", "user")
    @classmethod
    def _name(cls, v: str | None, info: ValidationInfo) -> str | None:
        return _utf8(v, info.field_name)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
        if v is not None and (
            len(v) > MAX_METADATA
            or any(len(k) > MAX_METADATA_KEY or len(x) > MAX_METADATA_VALUE for k, x in v.items())
        ):
            raise ValueError(
                f"metadata takes at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} "
                f"characters and values of at most {MAX_METADATA_VALUE}"
            )
        return _utf8(v, "metadata")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        return _neutral(v, 0, "penalties reshape the sampled distribution, which the record cannot express")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        return _neutral(v, 1, "each call is one recorded sample")

    def check(self) -> None:
        """Rules across fields (ParamError)."""
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options needs stream: true")
        if (
            None not in (self.max_tokens, self.max_completion_tokens)
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ParamError("max_completion_tokens", "max_tokens and max_completion_tokens disagree")


class ToolFunction(Strict):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunction


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    """An assistant turn's reasoning, as vLLM returns it (`reasoning` is its newer name): given to the
    template, which renders or drops it as the model was trained (Qwen3 drops earlier turns')."""
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: None = None  # the chat template does not render participant names
    refusal: None = None  # clients replaying an assistant turn send it as null

    def for_template(self) -> dict:
        """The message as the chat template expects it: text parts joined, null content kept null (a
        template may tell it from "": DeepSeek renders a turn's tool calls only without content)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Strict):
    """`response_format.json_schema`: the schema is enforced whatever `strict` says."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("messages", "tools")
    @classmethod
    def _text(cls, v: Any) -> Any:
        _utf8([m.model_dump() if isinstance(m, BaseModel) else m for m in v or []], "the text")
        return v

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        fmt = self.response_format
        if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
            raise ParamError("response_format.json_schema", "json_schema goes with type json_schema (only)")
        if fmt is not None and fmt.type != "text" and self.tool_choice not in (None, "none", "auto"):
            raise ParamError(
                "response_format", "a JSON reply and a required tool call cannot both be enforced"
            )
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ParamError("tool_choice", "tool_choice asks for a tool call but no tools are given")
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
            ):
                raise ParamError(f"tools.{i}", 'a tool is {"type": "function", "function": {"name": ...}}')
            if function.get("strict") and self.tool_choice in (None, "auto", "none"):
                raise ParamError(
                    f"tools.{i}.function.strict",
                    "strict schemas are enforced only with tool_choice required or named (enum parameters)",
                )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
    return_token_ids: bool = False

    @field_validator("prompt")
    @classmethod
    def _text(cls, v: str | list[int]) -> str | list[int]:
        return _utf8(v, "prompt")


class FeedbackRequest(Strict):
    trajectory_id: str = Field(min_length=1)
    """Exactly as the calls named it (any string; the body limit bounds it)."""
    reward: float
    comment: str | None = Field(None, max_length=10_000)
    overwrite: bool = False

    @field_validator("trajectory_id", "comment")
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return _utf8(v, info.field_name)

    @field_validator("reward")
    @classmethod
    def finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be a finite number")
        return v
