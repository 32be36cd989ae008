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
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.constraints import ChoiceConstraint
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import Completion
from prodrl_pipeline.engine.sampler import Request as EngineRequest
from prodrl_pipeline.envs.chat import TOOL_CALL_OPEN, parse_assistant_text, render_ids
from prodrl_pipeline.envs.tool_choice import required_tool_call
from prodrl_pipeline.gateway.batcher import BatchingEngine
from prodrl_pipeline.gateway.errors import error_response, validation_error
from prodrl_pipeline.gateway.guard import Guard
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.gateway.protocol import (
    ChatRequest,
    CompletionRequest,
    FeedbackRequest,
    ParamError,
    SamplingFields,
)
from prodrl_pipeline.gateway.responses import (
    Ending,
    chat_stream,
    cut_at_stop,
    logprobs_content,
    stop_at,
    text_of,
    usage,
)
from prodrl_pipeline.gateway.sessions import EXPIRED_TABLE, SessionIndex

TRAJECTORY_HEADER, CALL_HEADER = "X-Prodrl-Trajectory-Id", "X-Prodrl-Call-Id"
TRAJECTORY_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")  # safe in headers, paths and SQL predicates


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway serves and records."""

    deployment_id: str
    """The deployment served (recorded on every call; `model` in responses)."""
    model_aliases: tuple[str, ...] = ("live",)
    """Other names a request's `model` may give for the served deployment."""
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
    prefix: Counter = field(default_factory=Counter)
    """Later calls of a trajectory whose prompt extends / breaks its previous prompt + completion."""

    def render(self, gauges: dict[str, float]) -> str:
        lines = [
            f'prodrl_gateway_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.counts.items())
        ]
        lines += [f"prodrl_gateway_{k} {v}" for k, v in gauges.items()]
        return "\n".join(lines) + "\n"


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

    names = (cfg.deployment_id, *cfg.model_aliases)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.counts["400"] += 1
        return validation_error(list(exc.errors()))

    @app.exception_handler(ParamError)
    async def refused(_: Request, exc: ParamError) -> JSONResponse:
        metrics.counts["400"] += 1
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        metrics.counts[str(exc.status_code)] += 1
        return error_response(exc.status_code, str(exc.detail))

    def model_error(name: str) -> JSONResponse:
        metrics.counts["404"] += 1
        message = f"The model `{name}` does not exist; this gateway serves {', '.join(names)}"
        return error_response(404, message, "model", "model_not_found")

    def room() -> None:
        if landing and not landing.has_room():
            raise HTTPException(503, "recording backlog is full; retry later")

    def open_trajectory(req: SamplingFields, header: str | None, call_id: str) -> str:
        """The call's trajectory id, refused (409) when that trajectory expired unscored."""
        tid = trajectory_of(req, header, call_id)
        if sessions.is_expired(tid):
            raise HTTPException(
                409,
                f"trajectory {tid!r} expired unscored (TTL {sessions.ttl:g} s); start a new trajectory id",
            )
        return tid

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

    def sampling(prompt_ids: list[int], req: SamplingFields, prompt_param: str) -> SamplingParams:
        """The call's sampling parameters, once the prompt and every parameter are checked against
        the model and the engine (ParamError otherwise)."""
        room = max_positions - len(prompt_ids)
        asked = req.max_completion_tokens or req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            wanted = f" + max_tokens ({asked})" if asked is not None else ""
            raise ParamError(
                prompt_param if asked is None else "max_tokens",
                f"the prompt ({len(prompt_ids)} tokens){wanted} exceeds the {max_positions} positions",
            )
        vocab = engine.engine.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ParamError(prompt_param, f"prompt token ids must be in [0, {vocab})")
        if req.stop and "on_token" not in engine.engine.honours:
            raise ParamError("stop", "stop strings are not supported by this gateway's engine yet")
        shown = getattr(req, "top_logprobs", None) or getattr(req, "logprobs", None)
        if isinstance(shown, int) and not isinstance(shown, bool) and shown > engine.engine.top_logprobs:
            param = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
            raise ParamError(param, f"this gateway records the top {engine.engine.top_logprobs} log-probs")
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=asked or min(cfg.default_max_tokens, room),
            seed=req.seed,
        )

    def submit(
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str] | None,
        constraint: ChoiceConstraint | None = None,
        observe: Callable[[list[int]], bool] | None = None,
    ) -> Future:
        """Queue one completion: a future of (Completion, recorded seed). `observe` sees the ids
        after every token on the engine thread; it or a stop string returning True ends it."""
        hooks = [h for h in (observe, stop_at(tokenizer, stops) if stops else None) if h]
        on_token = (lambda ids: any([h(ids) for h in hooks])) if hooks else None  # noqa: E731 - every hook sees every token
        return engine.submit(EngineRequest(prompt_ids, params, constraint=constraint, on_token=on_token))

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
        extends = sessions.follow(tid, prompt_ids, c.token_ids)
        if extends is not None:
            metrics.prefix["extends" if extends else "breaks"] += 1
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
                "prefix_extends_total": metrics.prefix["extends"],
                "prefix_breaks_total": metrics.prefix["breaks"],
            }
        )

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "prodrl"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card(model_id) if model_id in names else model_error(model_id)

    async def required_call(req: ChatRequest) -> ChoiceConstraint | None:
        """The constraint enforcing `tool_choice` required or named (None for auto and none: as
        vLLM does, `none` keeps the tools in the prompt and returns the text as content)."""
        choice = req.tool_choice
        if choice is None or choice in ("none", "auto"):
            return None
        if "tool_choice" not in engine.engine.honours:
            raise ParamError(
                "tool_choice", "required or named tool calls are not supported by this engine yet"
            )
        if req.stop:
            raise ParamError("stop", "stop cannot cut a required tool call")
        name = None if choice == "required" else choice.function.name
        try:
            return await asyncio.to_thread(required_tool_call, tokenizer, req.tools, name)
        except ValueError as e:
            raise ParamError("tool_choice", str(e)) from e

    def stream_chat(req, call_id, tid, prompt_ids, params, constraint, messages, ids, created, reply):  # noqa: ANN001, ANN202, PLR0913
        """The SSE body of a streamed chat call: tokens as the engine produces them (an engine
        without per-token callbacks streams its finished completion); the call is recorded when
        its completion is done, before the last chunks; a client that leaves ends the generation
        at the next token and nothing is recorded."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()
        live = "on_token" in engine.engine.honours

        def observe(ids_so_far: list[int]) -> bool:
            try:
                loop.call_soon_threadsafe(tokens.put_nowait, (len(ids_so_far), ids_so_far[-1]))
            except RuntimeError:  # the event loop is gone (shutdown): end the generation
                return True
            return gone.is_set()

        future = submit(prompt_ids, params, req.stop, constraint, observe if live else None)

        def finished(f: Future) -> None:
            done = [] if live or f.cancelled() or f.exception() else f.result()[0].token_ids
            for n, t in enumerate(done, 1):
                loop.call_soon_threadsafe(tokens.put_nowait, (n, t))
            loop.call_soon_threadsafe(tokens.put_nowait, None)

        future.add_done_callback(finished)

        def end() -> Ending:
            if future.exception():  # an engine error surfaces here, before anything is recorded
                metrics.counts["engine_error"] += 1
            c, seed = future.result()
            message, finish, logprobs = reply(c)
            record(call_id, tid, prompt_ids, c, params, seed, messages + [message])
            metrics.counts["chat"] += 1
            ids["token_ids"] = c.token_ids
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return Ending(message, finish, logprobs, usage(prompt_ids, c) if include_usage else None)

        def abandon() -> None:
            gone.set()  # ends a running generation at its next token
            future.cancel()  # or drops a queued one
            metrics.counts["client_gone"] += 1

        return chat_stream(
            tokenizer,
            cfg.deployment_id,
            call_id,
            created,
            ids,
            tokens,
            end,
            abandon,
            stops=req.stop,
            tool_open=None if req.tool_choice == "none" else tokenizer.convert_tokens_to_ids(TOOL_CALL_OPEN),
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest, x_prodrl_trajectory_id: str | None = Header(None)):
        room()
        req.check()
        if req.model is not None and req.model not in names:
            return model_error(req.model)
        if req.parallel_tool_calls is False and req.tool_choice in (None, "auto"):
            raise ParamError(
                "parallel_tool_calls",
                "parallel_tool_calls: false is enforced with tool_choice required or named",
            )
        call_id = uuid.uuid4().hex
        tid = open_trajectory(req, x_prodrl_trajectory_id, call_id)
        try:  # user text stays text: only the template's markers are special tokens
            messages = [m.for_template() for m in req.messages]
            prompt_ids = await asyncio.to_thread(render_ids, tokenizer, messages, tools=req.tools)
        except Exception as e:  # a template error is the request's fault
            raise ParamError("messages", f"messages do not render with the chat template: {e}") from e
        params = sampling(prompt_ids, req, "messages")
        constraint = await required_call(req)
        headers = {TRAJECTORY_HEADER: tid, CALL_HEADER: call_id}
        ids = {"trajectory_id": tid, "call_id": call_id, "prompt_token_ids": prompt_ids}
        created = int(time.time())

        def reply(c: Completion) -> tuple[dict, str, dict | None]:
            """The assistant message, finish reason and logprobs of a finished completion."""
            text = text_of(tokenizer, c)
            text = cut_at_stop(text, req.stop) if c.finish_reason == "stop" else text
            if req.tool_choice == "none":  # as vLLM: the reply is text, tool-call markup included
                message = {"role": "assistant", "content": text}
            else:
                message = parse_assistant_text(text, call_id_prefix=f"call_{call_id[:12]}")
            tool_calls = bool(message.get("tool_calls"))
            finish = "tool_calls" if tool_calls else ("stop" if c.finish_reason == "stop" else "length")
            logprobs = (
                {"content": logprobs_content(tokenizer, c, req.top_logprobs or 0)} if req.logprobs else None
            )
            return message, finish, logprobs

        if req.stream:
            return StreamingResponse(
                stream_chat(req, call_id, tid, prompt_ids, params, constraint, messages, ids, created, reply),
                media_type="text/event-stream",
                headers=headers,
            )
        c, seed = await asyncio.wrap_future(submit(prompt_ids, params, req.stop, constraint))
        message, finish, logprobs = reply(c)
        metrics.counts["chat"] += 1
        ids["token_ids"] = c.token_ids
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
        if await request.is_disconnected():  # nobody will receive it: not recorded
            metrics.counts["client_gone"] += 1
            return response
        record(call_id, tid, prompt_ids, c, params, seed, messages + [message])  # the response is ready
        return response

    @app.post("/v1/completions")
    async def completions(
        request: Request, req: CompletionRequest, x_prodrl_trajectory_id: str | None = Header(None)
    ):
        room()
        req.check()
        if req.model is not None and req.model not in names:
            return model_error(req.model)
        if req.stream:
            raise ParamError("stream", "stream is supported on /v1/chat/completions only")
        call_id = uuid.uuid4().hex
        tid = open_trajectory(req, x_prodrl_trajectory_id, call_id)
        prompt_ids = (
            list(req.prompt)
            if isinstance(req.prompt, list)
            else await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=False)
        )
        params = sampling(prompt_ids, req, "prompt")
        c, seed = await asyncio.wrap_future(submit(prompt_ids, params, req.stop))
        text = text_of(tokenizer, c)
        if c.finish_reason == "stop":
            text = cut_at_stop(text, req.stop)
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
        if await request.is_disconnected():
            metrics.counts["client_gone"] += 1
            return response
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
