"""The gateway's requests, fuzzed with hypothesis against a real gateway process: chat, completion and
feedback bodies with up to three fields replaced by junk (wrong types, huge or negative numbers,
NaN, control-token text, nested junk, unknown fields, bytes that are not JSON). Every answer is a
success or a client error in OpenAI's error shape, never a server error; every answered call lands
exactly once and passes the data contract; and a sound request between the junk is still served."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prodrl_pipeline.gateway.serving import CALL_HEADER
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.records.validate import call_problem
from tests.gateway.conftest import FEEDBACK_KEY, SERVE_KEY

SERVE = {"Authorization": f"Bearer {SERVE_KEY}"}
FEEDBACK = {"Authorization": f"Bearer {FEEDBACK_KEY}"}
SOUND = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "1. e4"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "1. e4", "max_tokens": 4},
}
FIELDS = {
    "/v1/chat/completions": [
        "messages", "model", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
        "seed", "stop", "logit_bias", "n", "stream", "stream_options", "user", "metadata",
        "presence_penalty", "best_of", "tools", "tool_choice", "response_format", "logprobs",
        "top_logprobs", "unknown_field",
    ],
    "/v1/completions": [
        "prompt", "model", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "logit_bias",
        "stream", "logprobs", "echo", "suffix", "return_token_ids", "unknown_field",
    ],
    "/v1/feedback": ["trajectory_id", "reward", "comment", "overwrite", "unknown_field"],
}  # fmt: skip
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["<|im_start|>system\n", "<|im_end|>", "<tool_call>", "\x00", "\ud800x", "-1", "1e400"]),
)
JUNK = st.recursive(
    SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["role", "content", "type", "function", "name", "text", "x"]), inner),
    ),
    max_leaves=8,
)
TOOL = {"type": "function", "function": {"name": "move", "parameters": {"type": "object"}}}
EDGES = {  # values a client may well send, at the edges of what is allowed and just past them
    "messages": [[{"role": "user", "content": [{"type": "text", "text": "a"}]}], [{"role": "tool"}]],
    "model": ["base", "live", ""],
    "temperature": [0, 1e-9, 0.01, 2, 10, 10.0001],
    "top_p": [1e-9, 0.5, 1],
    "top_k": [0, 1, 5, 2**31 - 1, 2**31],
    "max_tokens": [1, 16, 10**9],
    "max_completion_tokens": [1, 4],
    "seed": [0, -(2**63), 2**63 - 1, 2**63],
    "stop": ["\n", ["e", "4"], [""], ["x"] * 5],
    "logit_bias": [{"5": 100}, {"5": -100, "6": 50}, {"007": 1, "7": 1}, {"99999999": 1}],
    "n": [1, 2],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}],
    "user": ["traj-1", "x" * 257, "alice@example.com", "süß\r\n 🙂", "50%"],
    "metadata": [{"trajectory_id": "t-9"}, {"k": 1}, {"trajectory_id": "a b\n"}, {"k": "x" * 513}],
    "presence_penalty": [0, 0.5],
    "best_of": [1, 2],
    "tools": [[TOOL], [TOOL, TOOL], [{"type": "function"}]],
    "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "move"}}],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}],
    "logprobs": [True, False, 0, 5, 20, 21],
    "top_logprobs": [0, 20, 21],
    "prompt": [[1, 2, 3], [10**9], "x" * 2000],
    "echo": [False, True],
    "return_token_ids": [True],
    "trajectory_id": ["", "x" * 300, "süß\r\n 🙂"],
    "reward": [0.0, -1e308, 1e308],
    "overwrite": [True],
}
GREEDY = "no sampling temperature > 0: a greedy call has no sampling distribution to train on"
STATUSES = {200, 400, 401, 404, 409, 413, 415, 422}


@st.composite
def requests(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(FIELDS)))
    body = dict(SOUND.get(path, {"trajectory_id": "none-such", "reward": 1.0}))
    for field in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3, unique=True)):
        edge = field in EDGES and draw(st.integers(0, 3)) > 0  # three in four: a plausible value
        body[field] = draw(st.sampled_from(EDGES[field]) if edge else JUNK)
    text = json.dumps(body, allow_nan=True)  # NaN and Infinity are not JSON: the server must say so
    raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate is not UTF-8 either
    if draw(st.integers(0, 4)) == 0:
        raw = raw[: len(raw) // 2]  # cut short
    return path, raw


def test_junk_requests_get_client_errors_and_every_answered_call_lands_once_and_sound(gateway):
    answered: list[str] = []
    statuses: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(requests())
    def one(request: tuple[str, bytes]) -> None:
        path, raw = request
        headers = {**(FEEDBACK if path == "/v1/feedback" else SERVE), "content-type": "application/json"}
        r = httpx.post(f"{gateway.url}{path}", content=raw, headers=headers, timeout=60)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in STATUSES, (path, raw[:300], r.status_code, r.text[:300])
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        elif path != "/v1/feedback":
            answered.append(r.headers[CALL_HEADER])

    one()
    for path, body in SOUND.items():  # still served after all that
        r = httpx.post(f"{gateway.url}{path}", json=body, headers=SERVE, timeout=60)
        assert r.status_code == 200, r.text[:300]
        answered.append(r.headers[CALL_HEADER])
    gateway.stop()  # commits the spool
    calls = DeltaStore(gateway.root / "tables").read("landing_calls").to_pylist()
    assert sorted(c["call_id"] for c in calls) == sorted(answered)  # each answered call, once
    for call in calls:  # each is a sound record of what was served; a greedy one is not trained on
        greedy = call["sampling"]["temperature"] == 0
        assert call_problem(call) == (GREEDY if greedy else None), call["call_id"]
    print(f"\nstatuses over {sum(statuses.values())} fuzzed requests: {dict(sorted(statuses.items()))}")
