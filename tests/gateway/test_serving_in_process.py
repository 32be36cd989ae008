"""The gateway's serving path in-process (no child process, so mutation testing sees it): the app
`python -m prodrl_pipeline.gateway` builds, over the tiny lab model's export, its embedded engine,
the landing log on real Delta tables and the lab tokenizer, driven through Starlette's TestClient;
and `Serving.stream_chat` driven directly where the order of a stream's events matters. What a
client sees and what is recorded: stop strings, forced tool calls, JSON replies, streams (live, and
from an engine without per-token callbacks), their usage, a client that leaves, and refusals."""

import asyncio
import json
import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from fastapi import HTTPException
from fastapi.testclient import TestClient

from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.engine.vllm import VLLMEngine
from prodrl_pipeline.envs.tool_choice import tool_call_ids
from prodrl_pipeline.gateway.__main__ import build_app, embedded_loader, parser
from prodrl_pipeline.gateway.batcher import BatchingEngine
from prodrl_pipeline.gateway.deployments import Deployments, Loaded
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.gateway.protocol import ChatRequest, ParamError
from prodrl_pipeline.gateway.responses import text_of
from prodrl_pipeline.gateway.serving import (
    CALL_HEADER,
    HEADER_ID_BYTES,
    TRAJECTORY_HEADER,
    GatewayConfig,
    Serving,
    header_id,
    id_headers,
)
from prodrl_pipeline.gateway.sessions import SessionIndex
from prodrl_pipeline.records.registry import live_deployment
from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.conftest import make_root

USER = [{"role": "user", "content": "Name a move."}]


def _tool(name: str, argument: str, values: list[str]) -> dict:
    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string", "enum": values}},
        "required": [argument],
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


MOVE, RESIGN = _tool("move", "move", ["e4", "Nf3"]), _tool("resign", "why", ["lost"])
SCHEMA = {
    "type": "object",
    "properties": {"move": {"type": "string", "enum": ["e4", "Nf3"]}},
    "required": ["move"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer) -> Path:
    """One store root with the tiny model live, shared by this file's gateways (each test reads
    back only its own calls)."""
    return make_root(tmp_path_factory.mktemp("gateway"), tokenizer)


@contextmanager
def _gateway(root: Path):
    """The gateway as `python -m prodrl_pipeline.gateway` builds it, serving in this process (no
    API keys, 16 tokens by default, not following the live pointer); its calls are committed when
    the block ends."""
    args = parser().parse_args(["--root", str(root), "--max-tokens", "16", "--follow-seconds", "0"])
    with TestClient(build_app(args)) as client:
        yield client


def _landed(root: Path, *call_ids: str) -> list[dict]:
    """The recorded calls among `call_ids`, in that order."""
    rows = {r["call_id"]: r for r in DeltaStore(root / "tables").read("landing_calls").to_pylist()}
    return [rows[c] for c in call_ids if c in rows]


def _chat(client: TestClient, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _refusal(client: TestClient, **body) -> tuple[int, str | None, str]:
    r = client.post("/v1/chat/completions", json={"messages": USER, **body})
    error = r.json()["error"]
    return r.status_code, error["param"], error["message"]


def _events(client: TestClient, **body) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    if lines[-1] == "data: [DONE]":  # an error event ends a stream without it
        lines.pop()
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def _streamed_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def _count(client: TestClient, outcome: str) -> int:
    prefix = f'prodrl_gateway_requests_total{{outcome="{outcome}"}} '
    lines = [x for x in client.get("/metrics").text.splitlines() if x.startswith(prefix)]
    return int(lines[0].removeprefix(prefix)) if lines else 0


def test_a_chat_call_is_answered_and_recorded_as_served(root, tokenizer):
    with _gateway(root) as client:
        first = _chat(client, max_tokens=6, seed=42, user="ip-1", logprobs=True, top_logprobs=2)
        again = _chat(client, max_tokens=6, seed=42, user="ip-1")
        assert _count(client, "chat") == 2
    ids, message = first["prodrl"], first["choices"][0]["message"]
    assert ids["trajectory_id"] == "ip-1" and ids["prompt_token_ids"] == render_ids(tokenizer, USER)
    assert 0 < len(ids["token_ids"]) == first["usage"]["completion_tokens"] <= 6
    assert again["prodrl"]["token_ids"] == ids["token_ids"]  # the same seed, the same draw
    shown = first["choices"][0]["logprobs"]["content"]
    assert len(shown) == len(ids["token_ids"]) and all(len(t["top_logprobs"]) == 2 for t in shown)
    one, two = _landed(root, ids["call_id"], again["prodrl"]["call_id"])
    assert (one["call_index"], two["call_index"]) == (0, 1)
    assert (one["trajectory_id"], one["deployment_id"], one["vocab_size"]) == ("ip-1", "base", len(tokenizer))
    assert one["prompt_token_ids"] == ids["prompt_token_ids"]
    assert one["completion_token_ids"] == ids["token_ids"]
    assert np.float32([t["logprob"] for t in shown]).tolist() == one["completion_logprobs"]
    assert (one["sampling"]["seed"], one["sampling"]["max_tokens"]) == (42, 6)
    assert one["finish_reason"] == first["choices"][0]["finish_reason"]
    assert json.loads(one["messages_json"]) == [*USER, message]


def test_a_stop_string_ends_the_generation_where_it_completes_and_the_reply_before_it(root, tokenizer):
    """The same seed's draw, run again with a stop string taken from its text: the engine stops at
    the token that completes the stop string (a prefix of the first draw is recorded), and the
    reply is the text before it; streamed, every token is seen by both the stream and the stop."""
    no_eos = {str(tokenizer.eos_token_id): -100}
    with _gateway(root) as client:
        free = _chat(client, max_tokens=12, seed=7, logit_bias=no_eos)
        text = free["choices"][0]["message"]["content"]
        stop = text[5:7]
        cut = _chat(client, max_tokens=12, seed=7, logit_bias=no_eos, stop=[stop, "never said"])
        events = _events(client, max_tokens=12, seed=7, logit_bias=no_eos, stop=[stop])
    before = text[: text.find(stop)]
    assert cut["choices"][0]["message"]["content"] == before and cut["choices"][0]["finish_reason"] == "stop"
    assert _streamed_text(events) == before and events[-1]["choices"][0]["finish_reason"] == "stop"
    drawn = free["prodrl"]["token_ids"]
    (recorded,) = _landed(root, cut["prodrl"]["call_id"])
    n = len(recorded["completion_token_ids"])
    assert recorded["completion_token_ids"] == drawn[:n] and recorded["finish_reason"] == "stop"
    assert stop not in tokenizer.decode(drawn[: n - 1]) and stop in tokenizer.decode(drawn[:n])
    assert events[-1]["prodrl"]["token_ids"] == drawn[:n]


def test_a_named_tool_choice_forces_that_call_and_required_forces_one_of_the_tools(root, tokenizer):
    with _gateway(root) as client:
        named = _chat(
            client,
            tools=[MOVE, RESIGN],
            tool_choice={"type": "function", "function": {"name": "resign"}},
            max_tokens=64,
        )
        required = _chat(client, tools=[MOVE, RESIGN], tool_choice="required", seed=1, max_tokens=64)
        streamed = _events(
            client,
            tools=[MOVE, RESIGN],
            tool_choice={"type": "function", "function": {"name": "resign"}},
            max_tokens=64,
        )
    (call,) = named["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "resign", "arguments": '{"why": "lost"}'}
    assert named["choices"][0]["finish_reason"] == "tool_calls"
    (done,) = required["choices"][0]["message"]["tool_calls"]
    arguments = json.loads(done["function"]["arguments"])
    assert (done["function"]["name"], arguments) in [
        ("move", {"move": "e4"}),
        ("move", {"move": "Nf3"}),
        ("resign", {"why": "lost"}),
    ]
    (streamed_call,) = [e for e in streamed if e.get("choices") and "tool_calls" in e["choices"][0]["delta"]]
    assert streamed_call["choices"][0]["delta"]["tool_calls"][0]["function"] == call["function"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert _streamed_text(streamed) == (named["choices"][0]["message"]["content"] or "")  # no call markup
    one, any_of = _landed(root, named["prodrl"]["call_id"], required["prodrl"]["call_id"])
    assert one["completion_token_ids"] == list(tool_call_ids(tokenizer, "resign", "why", "lost"))
    assert set(one["support_size"]) == {1}  # one call allowed: every token forced
    argument = "move" if done["function"]["name"] == "move" else "why"
    value = arguments[argument]
    assert any_of["completion_token_ids"] == list(
        tool_call_ids(tokenizer, done["function"]["name"], argument, value)
    )
    assert max(any_of["support_size"]) > 1  # where the three calls part, each was allowed
    assert json.loads(one["messages_json"])[-1]["tool_calls"][0]["function"] == call["function"]


def test_tool_choice_auto_and_none_leave_the_reply_free_with_the_tools_in_the_prompt(root, tokenizer):
    with _gateway(root) as client:
        free = {c: _chat(client, tools=[MOVE], tool_choice=c, max_tokens=4) for c in ("auto", "none")}
        unnamed = _chat(client, tools=[MOVE], max_tokens=4)
    rows = _landed(root, *(r["prodrl"]["call_id"] for r in (*free.values(), unnamed)))
    assert len(rows) == 3
    for row in rows:
        assert row["prompt_token_ids"] == render_ids(tokenizer, USER, tools=[MOVE])
        assert set(row["support_size"]) == {len(tokenizer)}  # nothing constrained the draw


def test_a_json_reply_follows_its_schema_and_a_schema_that_cannot_be_enforced_is_refused(root, tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    with _gateway(root) as client:
        shaped = _chat(client, response_format=fmt, max_tokens=64, seed=3)
        anything = _chat(client, response_format={"type": "json_object"}, max_tokens=3)
        text = _chat(client, response_format={"type": "text"}, max_tokens=3)
        bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
        assert _refusal(client, response_format=bad) == (
            400,
            "response_format",
            "the grammar cannot be enforced: Invalid type: nonsense",
        )
    assert json.loads(shaped["choices"][0]["message"]["content"])["move"] in {"e4", "Nf3"}
    assert anything["choices"][0]["message"]["content"].startswith("{")
    rows = _landed(root, *(r["prodrl"]["call_id"] for r in (shaped, anything, text)))
    assert [max(r["support_size"]) < len(tokenizer) for r in rows] == [True, True, False]


def test_forced_calls_and_stops_are_refused_by_name(root):
    with _gateway(root) as client:
        assert _refusal(
            client, tools=[MOVE], tool_choice={"type": "function", "function": {"name": "castle"}}
        ) == (
            400,
            "tool_choice",
            "tool_choice names 'castle', which is not among the tools",
        )
        assert _refusal(client, tools=[MOVE], tool_choice="required", stop=["x"]) == (
            400,
            "stop",
            "stop cannot cut a required tool call",
        )
        free = _tool("say", "text", ["a"])
        free["function"]["parameters"]["properties"]["text"] = {"type": "string"}
        status, param, _ = _refusal(client, tools=[free], tool_choice="required")
        assert (status, param) == (400, "tool_choice")


def test_a_stream_reports_its_usage_when_asked_and_is_recorded_as_streamed(root, tokenizer):
    with _gateway(root) as client:
        counted = _events(
            client,
            max_tokens=5,
            seed=9,
            stream_options={"include_usage": True},
            user="ip-s",
            logprobs=True,
            top_logprobs=1,
        )
        plain = _events(client, max_tokens=5, seed=9, stream_options={"include_usage": False}, user="ip-s")
        assert _count(client, "chat") == 2
    call_id = counted[0]["prodrl"]["call_id"]
    final = counted[-2]
    assert counted[-1]["choices"] == [] and counted[-1]["usage"] == {
        "prompt_tokens": len(counted[0]["prodrl"]["prompt_token_ids"]),
        "completion_tokens": len(final["prodrl"]["token_ids"]),
        "total_tokens": len(counted[0]["prodrl"]["prompt_token_ids"]) + len(final["prodrl"]["token_ids"]),
    }
    assert "usage" not in plain[-1] and plain[-1]["choices"][0]["finish_reason"] is not None
    shown = final["choices"][0]["logprobs"]["content"]
    assert len(shown) == len(final["prodrl"]["token_ids"]) and all(len(t["top_logprobs"]) == 1 for t in shown)
    assert "logprobs" not in plain[-1]["choices"][0]
    created = counted[0]["created"]
    assert isinstance(created, int) and created > 0
    assert {(e["id"], e["model"], e["created"]) for e in counted} == {
        (f"chatcmpl-{call_id}", "base", created)
    }
    (row, again) = _landed(root, call_id, plain[0]["prodrl"]["call_id"])
    assert row["completion_token_ids"] == final["prodrl"]["token_ids"] == again["completion_token_ids"]
    assert (row["call_index"], again["call_index"], row["trajectory_id"]) == (0, 1, "ip-s")
    assert tokenizer.decode(row["completion_token_ids"], skip_special_tokens=True) == _streamed_text(counted)
    assert json.loads(row["messages_json"]) == [
        *USER,
        {"role": "assistant", "content": _streamed_text(counted)},
    ]
    assert row["sampling"]["seed"] == 9 and final["choices"][0]["finish_reason"] == row["finish_reason"]


def test_a_stream_whose_grammar_fails_mid_reply_ends_with_the_request_s_error_and_records_nothing(root):
    """500 properties sharing a prefix compile, then overflow llguidance's parser a few tokens in."""
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(500)},
        "x-guidance": {"whitespace_flexible": False},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
    with _gateway(root) as client:
        events = _events(client, response_format=fmt, max_tokens=32, user="ip-wide")
        again = _events(client, response_format=fmt, max_tokens=32, user="ip-wide-2")
        assert (_count(client, "engine_error"), _count(client, "chat")) == (2, 0)
    assert again[-1]["error"]["param"] == "response_format"
    assert events[-1]["error"]["param"] == "response_format"
    assert _landed(root, events[0]["prodrl"]["call_id"]) == []


# -- Serving driven directly ------------------------------------------------------------------


def _serving(root: Path, tokenizer, spool: Path, engine: str = "embedded", vllm_status: int = 200) -> Serving:
    """A gateway's Serving from the same parts `build_app` assembles, its landing log started: the
    live tiny model in the embedded engine, or (`engine="vllm"`) the vLLM client over a stand-in
    vLLM server that answers every completion greedily with "e4 e5" and the end token (or, with
    another `vllm_status`, fails with it)."""
    store = DeltaStore(root / "tables")
    if engine == "embedded":
        loaded = embedded_loader(parser().parse_args([]), tokenizer, Artifacts(str(root)))(
            live_deployment(store)
        )
    else:
        reply = [*tokenizer.encode("e4 e5", add_special_tokens=False), tokenizer.eos_token_id]

        def vllm(request: httpx.Request) -> httpx.Response:
            if vllm_status != 200:
                return httpx.Response(vllm_status, json={"error": "the server failed"})
            n = min(json.loads(request.content)["max_tokens"], len(reply))
            choice = {
                "token_ids": reply[:n],
                "finish_reason": "stop" if n == len(reply) else "length",
                "logprobs": {
                    "token_logprobs": [0.0] * n,
                    "top_logprobs": [{f"token_id:{t}": 0.0} for t in reply[:n]],
                },
            }
            return httpx.Response(200, json={"choices": [choice]})

        client = VLLMEngine("http://vllm.invalid", "prodrl", len(tokenizer), top_logprobs=5)
        client.client = httpx.Client(transport=httpx.MockTransport(vllm))
        loaded = Loaded("vllm-base", BatchingEngine(client), 512)
    landing = LandingLog(store, spool, flush_records=1000, flush_seconds=3600)  # committed at stop
    landing.start()
    return Serving(GatewayConfig(), Deployments(loaded), tokenizer, landing, SessionIndex(60.0))


async def _stream(
    serving: Serving,
    req: ChatRequest,
    tid: str,
    leave_after_text: bool = False,
    paused=None,
    release_in_loop: bool = True,
) -> list:
    """Each event of a streamed chat call as (event, calls recorded so far); `leave_after_text`:
    the client leaves at the first text; `paused` (a `Paused`) is the call's constraint, told when
    text arrives (or, when the client leaves, once it has left, and then only with
    `release_in_loop`: else the caller releases it once the event loop is closed)."""
    prompt = serving.chat.prompt_ids([m.for_template() for m in req.messages])

    def reply(c):
        return {"role": "assistant", "content": text_of(serving.tokenizer, c)}, c.finish_reason, None

    with serving.leased(tid, None) as dep:
        params = serving.sampling(dep, prompt, req, "messages")
        constraint = paused or await serving.constraint(dep, req)
        ids = {"trajectory_id": tid, "call_id": f"call-{tid}"}
        messages = [m.for_template() for m in req.messages]
        stream = serving.stream_chat(
            dep, req, f"call-{tid}", tid, prompt, params, constraint, messages, ids, 0, reply, False
        )
    events = []
    async for line in stream:
        event = None if line == "data: [DONE]\n\n" else json.loads(line.removeprefix("data: "))
        events.append((event, serving.landing.pending))
        text = bool(event and event.get("choices") and event["choices"][0]["delta"].get("content"))
        if paused is not None and text and not leave_after_text:
            paused.text_seen.set()
        if leave_after_text and text:
            if paused is not None:  # leave once the engine is past the 1st token's callback
                await asyncio.to_thread(paused.taking_second.wait, 60)
            await stream.aclose()
            if paused is not None and release_in_loop:  # the client has left: on to the next token
                paused.text_seen.set()
                await asyncio.to_thread(serving.deployments.close)  # waits for it, the loop still running
            break
    return events


@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_a_stream_shows_text_before_its_call_is_recorded_and_records_it_before_the_end(
    root, tokenizer, tmp_path, engine
):
    """Text is sent as the engine produces it (vLLM's finished completion, token by token), the
    call is recorded once the completion is done, then the final chunks follow."""
    serving = _serving(root, tokenizer, tmp_path / "spool", engine)
    req = ChatRequest(messages=USER, max_tokens=8, seed=5, temperature=0.0, stream=True)
    try:
        events = asyncio.run(_stream(serving, req, f"ip-order-{engine}"))
    finally:
        serving.landing.stop()
        serving.deployments.close()
    texts = [
        (e["choices"][0]["delta"]["content"], n)
        for e, n in events
        if e and e["choices"][0]["delta"].get("content")
    ]
    assert texts and texts[0][1] == 0  # the first text came before the call was recorded
    final = [(e, n) for e, n in events if e and e["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0][1] == 1  # recorded before the last chunk
    assert events[-1] == (None, 1)
    (row,) = _landed(root, f"call-ip-order-{engine}")
    shown = "".join(t for t, _ in texts)
    assert final[0][0]["prodrl"]["token_ids"] == row["completion_token_ids"]
    assert text_of(tokenizer, _completion(row)) == shown
    if engine == "vllm":
        assert shown == "e4 e5" and row["deployment_id"] == "vllm-base" and row["finish_reason"] == "stop"
    assert serving.metrics.counts == {"chat": 1}


class Paused:
    """A constraint that allows every token and, taking the 2nd, waits until the test has seen the
    1st streamed as text (at most 60 s, far beyond a token's time): `waited` says whether text came
    while the completion was still being generated."""

    recorded = None  # every id allowed: nothing to recompute

    def __init__(self):
        self.text_seen, self.waited = threading.Event(), None
        self.taking_second = threading.Event()  # the 1st token's callbacks have all returned

    def start(self) -> "Paused":
        self.n = 0
        return self

    def allow(self, row) -> None:  # noqa: ANN001 - a [V] bool tensor
        row[:] = True

    def advance(self, token: int) -> None:  # noqa: ARG002
        self.n += 1
        if self.n == 2:
            self.taking_second.set()
            self.waited = self.text_seen.wait(60)

    def forced(self) -> list[int]:
        return []

    @property
    def finished(self) -> bool:
        return False


def test_the_embedded_engine_s_stream_shows_text_while_the_completion_is_generated(root, tokenizer, tmp_path):
    serving = _serving(root, tokenizer, tmp_path / "spool")
    no_eos = {str(tokenizer.eos_token_id): -100}
    req = ChatRequest(messages=USER, max_tokens=8, seed=5, logit_bias=no_eos, stream=True)
    paused = Paused()
    try:
        events = asyncio.run(_stream(serving, req, "ip-live", paused=paused))
    finally:
        serving.landing.stop()
        serving.deployments.close()
    assert paused.waited is True and paused.n == 8
    assert len(events[-2][0]["prodrl"]["token_ids"]) == 8


def test_a_client_that_leaves_ends_the_generation_at_its_next_token(root, tokenizer, tmp_path):
    serving = _serving(root, tokenizer, tmp_path / "spool")
    no_eos = {str(tokenizer.eos_token_id): -100}
    req = ChatRequest(messages=USER, max_tokens=8, seed=5, logit_bias=no_eos, stream=True)
    paused = Paused()
    try:
        asyncio.run(_stream(serving, req, "ip-left", leave_after_text=True, paused=paused))
    finally:
        serving.landing.stop()
        serving.deployments.close()
    assert paused.n == 2  # the token being made when the client left, not the 8 asked for
    assert serving.metrics.counts == {"client_gone": 1}


def test_a_generation_whose_event_loop_has_closed_ends_at_its_next_token(root, tokenizer, tmp_path):
    """The gateway shuts down (its event loop closes) while a stream's generation runs: the
    generation ends at the token being made, its tokens having nowhere to go."""
    serving = _serving(root, tokenizer, tmp_path / "spool")
    no_eos = {str(tokenizer.eos_token_id): -100}
    req = ChatRequest(messages=USER, max_tokens=8, seed=5, logit_bias=no_eos, stream=True)
    paused = Paused()
    try:
        asyncio.run(
            _stream(serving, req, "ip-shutdown", leave_after_text=True, paused=paused, release_in_loop=False)
        )
        paused.text_seen.set()  # the loop is closed: the engine takes its 2nd token now
        serving.deployments.close()  # waits for the generation to end
    finally:
        serving.landing.stop()
        serving.deployments.close()
    assert paused.n == 2  # the token being made when the loop closed, not the 8 asked for


def test_a_vllm_stream_that_fails_ends_with_an_error_event_counted_and_records_nothing(
    root, tokenizer, tmp_path
):
    serving = _serving(root, tokenizer, tmp_path / "spool", "vllm", vllm_status=500)
    req = ChatRequest(messages=USER, max_tokens=8, temperature=0.0, stream=True)
    try:
        events = asyncio.run(_stream(serving, req, "ip-vllm-down"))
    finally:
        serving.landing.stop()
        serving.deployments.close()
    error = events[-1][0]["error"]
    assert error["message"].startswith("generation failed: ") and "500" in error["message"]
    assert serving.metrics.counts == {"engine_error": 1}
    assert _landed(root, "call-ip-vllm-down") == []


def _completion(row: dict):
    from prodrl_pipeline.engine.rows import Completion

    return Completion(token_ids=row["completion_token_ids"], finish_reason=row["finish_reason"])


def test_a_client_that_leaves_a_stream_is_counted_and_its_call_is_not_recorded(
    root, tokenizer, tmp_path, caplog
):
    """The client leaves at the first text, and its event loop closes while the generation runs:
    the generation ends (closing the engine waits for it) without an error from its callbacks."""
    serving = _serving(root, tokenizer, tmp_path / "spool")
    no_eos = {str(tokenizer.eos_token_id): -100}
    req = ChatRequest(messages=USER, max_tokens=200, seed=5, logit_bias=no_eos, stream=True)
    try:
        events = asyncio.run(_stream(serving, req, "ip-gone", leave_after_text=True))
        asyncio.run(_stream(serving, req, "ip-gone-2", leave_after_text=True))
    finally:
        serving.landing.stop()
        serving.deployments.close()  # after the running generation has ended
    assert events[-1][0]["choices"][0]["delta"]["content"] and events[-1][1] == 0
    assert serving.metrics.counts == {"client_gone": 2}
    assert _landed(root, "call-ip-gone", "call-ip-gone-2") == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_an_engine_that_does_not_honour_a_constraint_refuses_it_by_name(root, tokenizer, tmp_path):
    """Both engines of the project honour tool_choice and response_format; one that did not (a
    future backend, declared by its `honours`) gets each request refused, naming the parameter."""
    serving = _serving(root, tokenizer, tmp_path / "spool")
    try:
        dep = serving.deployments.current
        dep.engine.engine.honours = frozenset({"on_token", "logit_bias"})
        forced = ChatRequest(messages=USER, tools=[MOVE], tool_choice="required")
        shaped = ChatRequest(messages=USER, response_format={"type": "json_object"})
        for req, param, message in (
            (forced, "tool_choice", "required or named tool calls are not supported by this engine yet"),
            (shaped, "response_format", "JSON replies are not supported by this engine yet"),
        ):
            with pytest.raises(ParamError) as refused:
                asyncio.run(serving.constraint(dep, req))
            assert (refused.value.param, str(refused.value)) == (param, message)
        assert asyncio.run(serving.constraint(dep, ChatRequest(messages=USER, tools=[MOVE]))) is None
    finally:
        serving.landing.stop()
        serving.deployments.close()


def test_a_chat_format_without_json_replies_refuses_them_by_name(root, tokenizer, tmp_path):
    """gpt-oss's harmony format has no JSON replies yet: refused before any engine is asked."""
    from tests.families import family_tokenizer

    harmony = family_tokenizer("gptoss")
    serving = _serving(root, tokenizer, tmp_path / "spool")
    try:
        other = Serving(GatewayConfig(), serving.deployments, harmony, None, SessionIndex(60.0))
        for fmt in (
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        ):
            with pytest.raises(ParamError) as refused:
                asyncio.run(
                    other.constraint(
                        serving.deployments.current, ChatRequest(messages=USER, response_format=fmt)
                    )
                )
            assert (refused.value.param, str(refused.value)) == (
                "response_format",
                "JSON replies are not supported for this model's chat format yet",
            )
    finally:
        serving.landing.stop()
        serving.deployments.close()


def test_a_trajectory_header_is_decoded_from_utf_8_escapes_and_refused_otherwise():
    assert header_id("a%20b%C3%A9%3A:") == "a bé::"
    for value, message in (
        ("a%zzb", "percent-encode the id as UTF-8 (a % starts %XX)"),
        ("ab%", "percent-encode the id as UTF-8 (a % starts %XX)"),
        ("é", "percent-encode the id as UTF-8 (a % starts %XX)"),  # not ASCII, even without a %
        ("%C3", "its escapes are not UTF-8"),
        ("ok%FFok", "its escapes are not UTF-8"),
    ):
        with pytest.raises(HTTPException) as refused:
            header_id(value)
        assert (refused.value.status_code, refused.value.detail) == (400, f"{TRAJECTORY_HEADER}: {message}")


def test_the_response_names_the_trajectory_in_a_header_up_to_its_size_limit():
    exact = "é" * (HEADER_ID_BYTES // 6) + "x" * (HEADER_ID_BYTES % 6)  # é escapes to %C3%A9: 6 bytes
    assert len(quote(exact, safe=":")) == HEADER_ID_BYTES
    assert id_headers(exact, "c1") == {CALL_HEADER: "c1", TRAJECTORY_HEADER: quote(exact, safe=":")}
    assert id_headers(exact + "x", "c2") == {CALL_HEADER: "c2"}  # one byte over: the body still has it
    assert id_headers("a b:c", "c3") == {CALL_HEADER: "c3", TRAJECTORY_HEADER: "a%20b:c"}


def test_the_models_a_request_may_name_are_the_loaded_deployments_then_the_aliases(root):
    with _gateway(root) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base", "live"]
        assert _chat(client, model="live", max_tokens=1)["model"] == "base"
        assert _refusal(client, model="gpt-4o") == (
            404,
            "model",
            "The model `gpt-4o` does not exist; this gateway serves base, live",
        )
