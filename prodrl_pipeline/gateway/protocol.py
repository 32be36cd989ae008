"""The OpenAI-compatible request schemas the gateway accepts (pydantic: a bad one is a 422)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingFields(BaseModel):
    """Sampling parameters shared by chat and completions (`top_k` is vLLM's extension)."""

    model_config = ConfigDict(extra="allow")  # other OpenAI fields are accepted and ignored

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=2**31 - 1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per call: each call is one recorded sample")
    stream: bool = False
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None


class ToolFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def for_template(self) -> dict:
        """The message as the chat template expects it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        out = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    return_token_ids: bool = False


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectory_id: str = Field(min_length=1, max_length=256)
    reward: float
    comment: str | None = Field(None, max_length=10_000)
    overwrite: bool = False

    @field_validator("reward")
    @classmethod
    def finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be a finite number")
        return v
