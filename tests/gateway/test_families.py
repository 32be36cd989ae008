"""Real model families through the gateway: a tiny random model of each family's vocabulary, served
with the family's own tokenizer and chat template, driven by the stock `openai` client. Every call
served is recorded with the prompt `apply_chat_template` gives for what the client sent; what a
template cannot render (tools, for the templates without them) is refused by name, never dropped."""

import json

import openai
import pytest

from prodrl_pipeline.chat.harmony import HarmonyChat
from prodrl_pipeline.chat.render import reads_argument_objects
from prodrl_pipeline.gateway.process import live_root
from prodrl_pipeline.model import build_model, pad_id
from prodrl_pipeline.records.store import DeltaStore
from tests.conftest import TINY
from tests.families import TEMPLATED, WEATHER, family_dir, family_tokenizer
from tests.gateway.conftest import SERVE_KEY, Gateway

WITH_TOOLS = {"qwen3", "llama3_2"}  # the families whose template renders tool definitions
THINKING = {"qwen3", "deepseek_v3"}


@pytest.fixture(scope="module", params=TEMPLATED)
def family_gateway(request, tmp_path_factory):
    family = request.param
    tok = family_tokenizer(family)
    root = live_root(tmp_path_factory.mktemp(family), build_model(TINY, len(tok), pad_id(tok)))
    gw = Gateway(root, "--tokenizer", str(family_dir(family))).start(timeout=180)
    yield family, tok, gw
    gw.stop()


def _reference(tok, messages, tools=None) -> list[int]:
    """`apply_chat_template`'s ids; a null content the template cannot take is given as "", and
    call arguments to a template that renders them from objects are parsed (the gateway's
    documented readings of both)."""
    if reads_argument_objects(tok):
        messages = [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in messages
        ]
    try:
        ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - Qwen3's template tests content as a string
        texts = [{**m, "content": "" if m.get("content") is None else m["content"]} for m in messages]
        ids = tok.apply_chat_template(texts, tools=tools, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _resent(user: list[dict], forced) -> list[dict]:  # noqa: ANN001
    """The conversation with a forced `get_weather` call (checked to be one) and its result."""
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Oslo",
        "Lima",
    )
    return [
        *user,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C"},
    ]


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=SERVE_KEY, max_retries=0)


def test_every_call_type_is_served_as_the_template_renders_it_or_refused_by_name(family_gateway):
    family, tok, gw = family_gateway
    client = _client(gw)
    sent: dict[str, tuple[list[dict], list | None]] = {}

    def chat(name: str, messages: list[dict], tools: list | None = None, **kwargs) -> object:
        kwargs = {"max_tokens": 6, **kwargs}
        reply = client.chat.completions.create(
            model="base", messages=messages, tools=tools or openai.NOT_GIVEN, **kwargs
        )
        sent[reply.model_extra["prodrl"]["call_id"]] = (messages, tools)
        return reply

    user = [{"role": "user", "content": "Hello there"}]
    chat("plain", user)
    chat("whitespace", [{"role": "system", "content": "  brief \n"}, {"role": "user", "content": "\n hi  "}])
    first = chat("multi-turn", user)
    chat(
        "multi-turn 2", [*user, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More"}]
    )
    if family in THINKING:
        history = {"role": "assistant", "content": "<think>\nreasoning\n</think>\n\nAnswer."}
        chat("reasoning in history", [*user, history, {"role": "user", "content": "Again"}])
    chat("logprobs", user, logprobs=True, top_logprobs=3)
    chat("json", user, response_format={"type": "json_object"})
    stream = client.chat.completions.create(model="base", messages=user, max_tokens=6, stream=True)
    chunks = list(stream)
    sent[chunks[0].model_extra["prodrl"]["call_id"]] = (user, None)
    if family in WITH_TOOLS:
        chat("tools auto", user, [WEATHER])
        forced = chat("tools required", user, [WEATHER], tool_choice="required", max_tokens=64)
        chat(
            "tools named",
            user,
            [WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64,
        )
        resent = _resent(user, forced)
        chat("tool history", resent, [WEATHER])
        streamed = list(
            client.chat.completions.create(
                model="base",
                messages=user,
                tools=[WEATHER],
                tool_choice="required",
                max_tokens=64,
                stream=True,
            )
        )
        sent[streamed[0].model_extra["prodrl"]["call_id"]] = (user, [WEATHER])
        deltas = [c.choices[0].delta for c in streamed if c.choices]
        assert "".join(d.content or "" for d in deltas) == ""  # the call's text is never shown as content
        (call,) = [tc for d in deltas for tc in d.tool_calls or []]
        assert call.function.name == "get_weather" and streamed[-1].choices[0].finish_reason == "tool_calls"
    else:
        with pytest.raises(openai.BadRequestError, match="renders no tool definitions"):
            chat("tools", user, [WEATHER])
    assert first.choices[0].finish_reason in ("stop", "length")

    gw.stop()
    landed = {r["call_id"]: r for r in DeltaStore(gw.root / "tables").read("landing_calls").to_pylist()}
    assert set(sent) <= set(landed)
    for call_id, (messages, tools) in sent.items():
        assert landed[call_id]["prompt_token_ids"] == _reference(tok, messages, tools), (family, messages)
    if family in WITH_TOOLS:  # the forced call, re-sent as history, extends the prompt it was served with
        served = landed[forced.model_extra["prodrl"]["call_id"]]
        again = _reference(tok, [*resent[:2], {"role": "user", "content": "next"}], [WEATHER])
        assert again[: len(served["prompt_token_ids"]) + len(served["completion_token_ids"])] == (
            served["prompt_token_ids"] + served["completion_token_ids"]
        )


@pytest.fixture(scope="module")
def gptoss_gateway(tmp_path_factory):
    tok = family_tokenizer("gptoss")
    root = live_root(tmp_path_factory.mktemp("gptoss"), build_model(TINY, len(tok), pad_id(tok)))
    gw = Gateway(root, "--tokenizer", str(family_dir("gptoss"))).start(timeout=180)
    yield tok, gw
    gw.stop()


def test_gpt_oss_is_served_in_harmony_and_recorded_with_harmony_prompts(gptoss_gateway):
    """gpt-oss (no chat template) through the gateway: every prompt recorded is openai-harmony's
    rendering of what the client sent (chat/harmony.py's mapping, as vLLM's), a forced call is
    harmony's commentary call ending at <|call|>, and a reply parses back to an OpenAI message."""
    tok, gw = gptoss_gateway
    client = _client(gw)
    harmony = HarmonyChat(tok)
    sent: dict[str, tuple[list[dict], list | None]] = {}

    def chat(messages: list[dict], tools: list | None = None, **kwargs) -> object:
        kwargs = {"max_tokens": 6, **kwargs}
        reply = client.chat.completions.create(
            model="base", messages=messages, tools=tools or openai.NOT_GIVEN, **kwargs
        )
        sent[reply.model_extra["prodrl"]["call_id"]] = (messages, tools)
        return reply

    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    plain = chat(user)
    assert plain.choices[0].finish_reason in ("stop", "length")
    history = {"role": "assistant", "content": "Hi.", "reasoning_content": "a greeting"}
    chat([*user, history, {"role": "user", "content": "Again"}])
    chat(user, logprobs=True, top_logprobs=3)
    chunks = list(client.chat.completions.create(model="base", messages=user, max_tokens=6, stream=True))
    sent[chunks[0].model_extra["prodrl"]["call_id"]] = (user, None)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    chat(user, [WEATHER])
    forced = chat(user, [WEATHER], tool_choice="required", max_tokens=64)
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat(user, [WEATHER], tool_choice=named, max_tokens=64)
    assert forced.choices[0].finish_reason == "tool_calls"
    resent = _resent(user, forced)
    chat(resent, [WEATHER])
    with pytest.raises(openai.BadRequestError, match="JSON replies"):
        chat(user, response_format={"type": "json_object"})

    gw.stop()
    landed = {r["call_id"]: r for r in DeltaStore(gw.root / "tables").read("landing_calls").to_pylist()}
    assert set(sent) <= set(landed)
    for call_id, (messages, tools) in sent.items():
        assert landed[call_id]["prompt_token_ids"] == harmony.prompt_ids(messages, tools), messages
    texts = {harmony.enc.decode(landed[i]["prompt_token_ids"]) for i in sent}
    assert not any("a greeting" in t for t in texts)  # an earlier turn's reasoning is dropped
    assert any(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>-3 C" in t for t in texts
    )
    served = landed[forced.model_extra["prodrl"]["call_id"]]["completion_token_ids"]
    header = harmony.enc.encode(
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>", allowed_special="all"
    )
    assert served[: len(header)] == header and served[-1] == tok.convert_tokens_to_ids("<|call|>")
    stops = harmony.stop_ids
    for record in landed.values():  # the engine stopped at <|return|> and <|call|>
        assert not stops & set(record["completion_token_ids"][:-1])
