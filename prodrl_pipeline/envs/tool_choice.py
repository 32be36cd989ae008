"""Tool calls as structured outputs: the completions a required tool call may take, as a
`ChoiceConstraint` over the model family's own tool-call ids (`chat.tool_calls.call_ids`: the
template's rendering of the call, so a re-sent call extends the prompt it was served with).

The lab asks for `move({"move": m})` with m among the legal moves; the gateway asks for the same
when a client sends `tool_choice` with tools whose one parameter is a string `enum` (the only
argument schema a choice constraint expresses exactly). Names and values are plain text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.tool_calls import call_ids
from prodrl_pipeline.engine.constraints import ChoiceConstraint

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_CHOICES, MAX_CHOICE_CHARS = 1000, 256  # bounds on a client's enum: OpenAI's count, a length


def _call_ids(
    tokenizer: PreTrainedTokenizerBase,
    tool_name: str,
    argument: str,
    value: str,
    render: Callable[[str, str], Sequence[int]] | None = None,
) -> tuple[int, ...]:
    if not TOOL_NAME.fullmatch(tool_name):
        raise ValueError(f"tool name {tool_name!r} is not 1-64 characters of [A-Za-z0-9_-]")
    arguments = json.dumps({argument: value}, ensure_ascii=False)
    return tuple(render(tool_name, arguments)) if render else call_ids(tokenizer, tool_name, arguments)


@lru_cache(maxsize=1 << 16)
def tool_call_ids(
    tokenizer: PreTrainedTokenizerBase, tool_name: str, argument: str, value: str
) -> tuple[int, ...]:
    """The completion ids of one tool call `tool_name({argument: value})` ending the turn. Cached
    for the lab (a round builds a constraint per turn over ~35 legal moves, drawn from a few
    thousand); client-given values go through the uncached path, which a client cannot fill."""
    return _call_ids(tokenizer, tool_name, argument, value)


def tool_choice_constraint(
    tokenizer: PreTrainedTokenizerBase, tool_name: str, argument: str, values: Sequence[str]
) -> ChoiceConstraint:
    """One tool call `tool_name({argument: v})` with v among `values`, then the end of the turn.
    The wrapper tokens are forced; only the argument's tokens are choices."""
    return ChoiceConstraint([tool_call_ids(tokenizer, tool_name, argument, v) for v in values])


def _enum_argument(tool: dict) -> tuple[str, str, list[str]]:
    """(name, argument, values) of a tool whose parameters are one string property with an enum."""
    name = _tool_name(tool)
    if not isinstance(name, str):
        raise ValueError("every tool needs function.name")
    params = tool["function"].get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    if isinstance(props, dict) and len(props) == 1:
        ((argument, schema),) = props.items()
        values = schema.get("enum") if isinstance(schema, dict) else None
        if (
            isinstance(values, list)
            and values
            and all(isinstance(v, str) for v in values)
            and schema.get("type", "string") == "string"
        ):
            return name, argument, values
    raise ValueError(
        f"tool {name!r}: a required tool call is constrained to a choice, so its parameters must be "
        "one string property with an `enum` of the allowed values"
    )


def required_tool_call(
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict],
    name: str | None = None,
    render: Callable[[str, str], Sequence[int]] | None = None,
) -> ChoiceConstraint:
    """`tool_choice: "required"` (any of `tools`) or a named tool: a constraint over every call
    the chosen tools' enums allow, each call's ids from `render(name, arguments)` (default: the
    template's, `call_ids`; harmony's for gpt-oss). ValueError when a chosen tool's schema is not
    such an enum."""
    chosen = [t for t in tools if name is None or _tool_name(t) == name]
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    calls = [
        (tool_name, argument, v)
        for t in chosen
        for tool_name, argument, vs in [_enum_argument(t)]
        for v in vs
    ]
    if len(calls) > MAX_CHOICES or any(len(v) > MAX_CHOICE_CHARS for _, _, v in calls):
        raise ValueError(
            f"a required tool call allows at most {MAX_CHOICES} values of {MAX_CHOICE_CHARS} characters"
        )
    return ChoiceConstraint([_call_ids(tokenizer, *call, render) for call in dict.fromkeys(calls)])


def _tool_name(tool: object) -> object:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function.get("name") if isinstance(function, dict) else None
