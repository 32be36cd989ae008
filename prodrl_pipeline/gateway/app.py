"""The capture gateway: an OpenAI-compatible server that records every call exactly as served.

Endpoints: /v1/chat/completions (tools, `stream`), /v1/completions (text or token-id prompts),
/v1/models, /v1/feedback (late reward), /healthz, /metrics. A trajectory is a session: the client
names it with the `X-Prodrl-Trajectory-Id` header, `metadata.trajectory_id`, or `user` (first
found); a call without one is a single-call trajectory. Every response carries the ids to send
feedback for (`prodrl` field, `X-Prodrl-Trajectory-Id` / `X-Prodrl-Call-Id` headers). A call is in
the landing spool before its response is sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import Completion
from prodrl_pipeline.engine.sampler import Request as EngineRequest
from prodrl_pipeline.envs.chat import parse_assistant_text, render_ids
from prodrl_pipeline.gateway.batcher import BatchingEngine
from prodrl_pipeline.gateway.guard import Guard
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.gateway.protocol import ChatRequest, CompletionRequest, FeedbackRequest, SamplingFields
from prodrl_pipeline.gateway.responses import chat_stream, logprobs_content, text_of, usage
from prodrl_pipeline.gateway.sessions import EXPIRED_TABLE, SessionIndex

TRAJECTORY_HEADER, CALL_HEADER = "X-Prodrl-Trajectory-Id", "X-Prodrl-Call-Id"
TRAJECTORY_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")  # safe in headers, paths and SQL predicates


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway serves and records."""

    deployment_id: str
    """The deployment served (recorded on every call; `model` in responses)."""
    serve_keys: tuple[str, ...] = ()
    """API keys accepted on the serving endpoints (empty: no key needed)."""
    feedback_keys: tuple[str, ...] = ()
    """API keys accepted on /v1/feedback (empty: no key needed)."""
    max_body_bytes: int = 1_000_000
    """Larger request bodies are refused with 413."""
    default_max_tokens: int = 256
    """Completion length when the request gives none."""
    record: bool = True
    """Record calls (off only for benchmarking the recording cost)."""


@dataclass
class Metrics:
    counts: Counter = field(default_factory=Counter)

    def render(self, gauges: dict[str, float]) -> str:
        lines = [
            f'prodrl_gateway_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.counts.items())
        ]
        lines += [f"prodrl_gateway_{k} {v}" for k, v in gauges.items()]
        return "\n".join(lines) + "\n"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(
    cfg: GatewayConfig,
    engine: BatchingEngine,
    tokenizer: PreTrainedTokenizerBase,
    landing: LandingLog | None,
    sessions: SessionIndex,
    max_positions: int,
) -> FastAPI:
    metrics = Metrics()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if landing:
            landing.start()
            sessions.load(landing.store)
        yield
        if landing:
            landing.stop()
        engine.close()

    app = FastAPI(title="prodrl capture gateway", lifespan=lifespan)

    app.add_middleware(
        Guard,
        serve_keys=cfg.serve_keys,
        feedback_keys=cfg.feedback_keys,
        max_body_bytes=cfg.max_body_bytes,
        count=lambda outcome: metrics.counts.update([outcome]),
    )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.counts["422"] += 1
        return _error(422, json.dumps(jsonable_errors(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        metrics.counts[str(exc.status_code)] += 1
        return _error(exc.status_code, str(exc.detail))

    def room() -> None:
        if landing and not landing.has_room():
            raise HTTPException(503, "recording backlog is full; retry later")

    def trajectory_of(req: SamplingFields, header: str | None, call_id: str) -> str:
        given = [
            (TRAJECTORY_HEADER, header),
            ("metadata.trajectory_id", (req.metadata or {}).get("trajectory_id")),
            ("user", req.user),
        ]
        for name, tid in given:
            if tid is None or tid == "":
                continue
            if not TRAJECTORY_ID.fullmatch(tid):
                raise HTTPException(400, f"{name}: a trajectory id is 1-256 characters of [A-Za-z0-9_.:-]")
            return tid
        return call_id

    async def run(prompt_ids: list[int], req: SamplingFields) -> tuple[Completion, SamplingParams, int]:
        max_tokens = req.max_completion_tokens or req.max_tokens or cfg.default_max_tokens
        if len(prompt_ids) + max_tokens > max_positions:
            raise HTTPException(
                422,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the model's {max_positions} positions",
            )
        if any(not 0 <= t < engine.engine.vocab_size for t in prompt_ids):
            raise HTTPException(422, f"prompt token ids must be in [0, {engine.engine.vocab_size})")
        params = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=max_tokens,
            seed=req.seed,
        )
        completion, seed = await asyncio.wrap_future(engine.submit(EngineRequest(prompt_ids, params)))
        return completion, params, seed

    def record(
        call_id: str,
        tid: str,
        prompt_ids: list[int],
        c: Completion,
        params: SamplingParams,
        seed: int,
        messages: list[dict] | dict,
    ) -> None:
        index = sessions.next_call_index(tid)
        if not (landing and cfg.record):
            return
        landing.append(
            "call",
            {
                "call_id": call_id,
                "trajectory_id": tid,
                "call_index": index,
                "deployment_id": cfg.deployment_id,
                "prompt_token_ids": prompt_ids,
                "completion_token_ids": c.token_ids,
                "completion_logprobs": c.logprobs,
                "topk_token_ids": c.topk_ids,
                "topk_logprobs": c.topk_logprobs,
                "support_size": c.support_size,
                "support_token_ids": c.support_ids,
                "extra_token_ids": c.extra_ids,
                "vocab_size": engine.engine.vocab_size,
                "sampling": {**asdict(params), "seed": seed},
                "finish_reason": c.finish_reason,
                "messages_json": json.dumps(messages),
                "created_at": datetime.now(UTC),
            },
        )

    @app.get("/healthz")
    async def healthz() -> dict:
        return {
            "status": "ok",
            "deployment_id": cfg.deployment_id,
            "pending_records": landing.pending if landing else 0,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_endpoint() -> str:
        return metrics.render(
            {
                "pending_records": landing.pending if landing else 0,
                "committed_records": landing.committed_records if landing else 0,
                "trajectories": len(sessions),
                "expired_trajectories": sessions.n_expired,
            }
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": cfg.deployment_id, "object": "model", "created": started, "owned_by": "prodrl"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, x_prodrl_trajectory_id: str | None = Header(None)):
        room()
        call_id = uuid.uuid4().hex
        tid = trajectory_of(req, x_prodrl_trajectory_id, call_id)
        try:  # user text stays text: only the template's markers are special tokens
            messages = [m.for_template() for m in req.messages]
            prompt_ids = await asyncio.to_thread(render_ids, tokenizer, messages, tools=req.tools)
        except Exception as e:  # a template error is the request's fault
            raise HTTPException(422, f"messages do not render with the chat template: {e}") from e
        c, params, seed = await run(prompt_ids, req)
        message = parse_assistant_text(text_of(tokenizer, c), call_id_prefix=f"call_{call_id[:12]}")
        metrics.counts["chat"] += 1
        finish = (
            "tool_calls" if message.get("tool_calls") else ("stop" if c.finish_reason == "stop" else "length")
        )
        ids = {
            "trajectory_id": tid,
            "call_id": call_id,
            "prompt_token_ids": prompt_ids,
            "token_ids": c.token_ids,
        }
        headers = {TRAJECTORY_HEADER: tid, CALL_HEADER: call_id}
        logprobs = (
            {"content": logprobs_content(tokenizer, c, req.top_logprobs or 0)} if req.logprobs else None
        )
        created = int(time.time())
        if req.stream:
            record(call_id, tid, prompt_ids, c, params, seed, messages + [message])
            return StreamingResponse(
                chat_stream(
                    tokenizer, cfg.deployment_id, call_id, created, c, message, finish, ids, logprobs
                ),
                media_type="text/event-stream",
                headers=headers,
            )
        response = JSONResponse(
            {
                "id": f"chatcmpl-{call_id}",
                "object": "chat.completion",
                "created": created,
                "model": cfg.deployment_id,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
                "usage": usage(prompt_ids, c),
                "prodrl": ids,
            },
            headers=headers,
        )
        record(call_id, tid, prompt_ids, c, params, seed, messages + [message])  # the response is ready
        return response

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, x_prodrl_trajectory_id: str | None = Header(None)):
        room()
        if req.stream:
            raise HTTPException(422, "stream is supported on /v1/chat/completions only")
        call_id = uuid.uuid4().hex
        tid = trajectory_of(req, x_prodrl_trajectory_id, call_id)
        prompt_ids = (
            list(req.prompt)
            if isinstance(req.prompt, list)
            else tokenizer.encode(req.prompt, add_special_tokens=False)
        )
        c, params, seed = await run(prompt_ids, req)
        text = text_of(tokenizer, c)
        metrics.counts["completion"] += 1
        choice = {"index": 0, "text": text, "finish_reason": c.finish_reason, "logprobs": None}
        if req.logprobs is not None:
            tok = tokenizer.convert_ids_to_tokens
            choice["logprobs"] = {
                "tokens": [tok(t) for t in c.token_ids],
                "token_logprobs": c.logprobs,
                "top_logprobs": [
                    {tok(i): x for i, x in zip(ids[: req.logprobs], lps[: req.logprobs], strict=True)}
                    for ids, lps in zip(c.topk_ids, c.topk_logprobs, strict=True)
                ],
            }
        ids = {"trajectory_id": tid, "call_id": call_id}
        if req.return_token_ids:
            choice.update(prompt_token_ids=prompt_ids, token_ids=c.token_ids)
        response = JSONResponse(
            {
                "id": f"cmpl-{call_id}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": cfg.deployment_id,
                "choices": [choice],
                "usage": usage(prompt_ids, c),
                "prodrl": ids,
            },
            headers={TRAJECTORY_HEADER: tid, CALL_HEADER: call_id},
        )
        record(call_id, tid, prompt_ids, c, params, seed, {"prompt": req.prompt, "completion": text})
        return response

    @app.post("/v1/feedback")
    async def feedback(req: FeedbackRequest) -> dict:
        room()
        status = sessions.claim_reward(req.trajectory_id, req.overwrite)
        if status == "unknown":
            raise HTTPException(404, f"unknown trajectory {req.trajectory_id!r}")
        if status == "expired":
            raise HTTPException(
                409, f"trajectory {req.trajectory_id!r} expired unscored (TTL {sessions.ttl:g} s)"
            )
        if status == "rewarded":
            raise HTTPException(
                409, f"trajectory {req.trajectory_id!r} already has a reward; send overwrite=true"
            )
        if landing:
            try:
                landing.append(
                    "feedback",
                    {
                        "feedback_id": uuid.uuid4().hex,
                        "trajectory_id": req.trajectory_id,
                        "reward": req.reward,
                        "comment": req.comment,
                        "overwrite": req.overwrite,
                        "received_at": datetime.now(UTC),
                    },
                )
            except Exception:
                sessions.release_reward(req.trajectory_id)  # not recorded: a retry must not get 409
                raise
        metrics.counts["feedback"] += 1
        return {"status": "recorded", "trajectory_id": req.trajectory_id}

    return app


def expire_unscored(landing: LandingLog | None, sessions: SessionIndex) -> int:
    """Move trajectories unscored past the TTL to `rejects` (through the spool: exactly once)."""
    expired = sessions.expire()
    if landing:
        now = datetime.now(UTC)
        for tid in expired:
            landing.append(
                "reject",
                {
                    "table_name": EXPIRED_TABLE,
                    "round": None,
                    "record_id": tid,
                    "reason": f"no reward within the TTL of {sessions.ttl:g} s",
                    "record_json": "{}",
                    "rejected_at": now,
                },
            )
    return len(expired)


def jsonable_errors(errors: list[dict]) -> list[dict]:
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in errors]
