"""The capture gateway: an OpenAI-compatible server that records every call exactly as served.

Endpoints: /v1/chat/completions (tools, `stream`), /v1/completions (text or token-id prompts),
/v1/models, /v1/feedback (late reward), /healthz, /metrics. A trajectory is a session: the client
names it with the `X-Prodrl-Trajectory-Id` header, `metadata.trajectory_id`, or `user` (first
found; any string, kept exactly); a call without one is a single-call trajectory. Every response
carries the ids to send feedback for (`prodrl` field, `X-Prodrl-Trajectory-Id` (percent-encoded) /
`X-Prodrl-Call-Id` headers). A call is in the landing spool before its response is sent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from prodrl_pipeline.chat.render import TemplateError
from prodrl_pipeline.engine.constraints import ConstraintError
from prodrl_pipeline.engine.rows import Completion
from prodrl_pipeline.gateway.errors import error_response, validation_error
from prodrl_pipeline.gateway.guard import Guard
from prodrl_pipeline.gateway.protocol import (
    ChatRequest,
    CompletionRequest,
    FeedbackRequest,
    ParamError,
)
from prodrl_pipeline.gateway.responses import (
    cut_at_stop,
    logprobs_content,
    text_of,
    usage,
)
from prodrl_pipeline.gateway.serving import Serving, id_headers


def create_app(serving: Serving) -> FastAPI:
    """The routes over `serving` (its deployments, tokenizer, landing log and sessions)."""
    cfg, tokenizer, deployments = serving.cfg, serving.tokenizer, serving.deployments
    chat_format = serving.chat  # the chat template's, or harmony's for gpt-oss (gateway/chat_format.py)
    landing, sessions, metrics = serving.landing, serving.sessions, serving.metrics
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if landing:
            landing.start()
            sessions.load(landing.store)
        if serving.follower:
            serving.follower.start()
        yield
        if serving.follower:
            serving.follower.stop()
        if landing:
            landing.stop()
        deployments.close()

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
        message = f"The model `{name}` does not exist; this gateway serves {', '.join(serving.names())}"
        return error_response(404, message, "model", "model_not_found")

    def room() -> None:
        if landing and not landing.has_room():
            raise HTTPException(503, "recording backlog is full; retry later")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {
            "status": "ok",
            "deployment_id": deployments.current.deployment_id,
            "canary": deployments.canary and deployments.canary.canary_id,
            "draining": deployments.draining(),
            "follow_error": deployments.last_error,
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
                "deployments_loaded": len(deployments.ids()),
                "deployment_switches_total": deployments.switches,
                "deployment_load_failures_total": deployments.load_failures,
                "calls_moved_deployment_total": metrics.moved,
            }
        )

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "prodrl"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in serving.names()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card(model_id) if model_id in serving.names() else model_error(model_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest, x_prodrl_trajectory_id: str | None = Header(None)):
        room()
        req.check()
        if req.model is not None and req.model not in serving.names():
            return model_error(req.model)
        if req.parallel_tool_calls is False and req.tool_choice in (None, "auto"):
            raise ParamError(
                "parallel_tool_calls",
                "parallel_tool_calls: false is enforced with tool_choice required or named",
            )
        if req.tools and not chat_format.serves_tools:
            raise ParamError(
                "tools", "this model's chat template renders no tool definitions: tools cannot be served"
            )
        call_id = uuid.uuid4().hex
        tid = serving.open_trajectory(req, x_prodrl_trajectory_id, call_id)
        try:  # user text stays text: only the template's markers are control tokens
            messages = [m.for_template() for m in req.messages]
            prompt_ids = await asyncio.to_thread(chat_format.prompt_ids, messages, req.tools)
        except TemplateError as e:
            raise ParamError("messages", str(e)) from e
        except Exception as e:  # a template error is the request's fault
            raise ParamError("messages", f"messages do not render with the chat template: {e}") from e
        json_reply = req.response_format is not None and req.response_format.type != "text"
        parse_calls = bool(req.tools) and req.tool_choice != "none" and not json_reply
        headers = id_headers(tid, call_id)
        ids = {"trajectory_id": tid, "call_id": call_id, "prompt_token_ids": prompt_ids}
        created = int(time.time())

        def reply(c: Completion) -> tuple[dict, str, dict | None]:
            """The assistant message, finish reason and logprobs of a finished completion."""
            message = chat_format.reply(c, req.stop, parse_calls, f"call_{call_id[:12]}")
            tool_calls = bool(message.get("tool_calls"))
            finish = "tool_calls" if tool_calls else ("stop" if c.finish_reason == "stop" else "length")
            logprobs = (
                {"content": logprobs_content(tokenizer, c, req.top_logprobs or 0)} if req.logprobs else None
            )
            return message, finish, logprobs

        with serving.leased(tid, req.model) as dep:  # the deployment stays open until submitted
            params = serving.sampling(dep, prompt_ids, req, "messages")
            constraint = await serving.constraint(dep, req)
            if req.stream:
                return StreamingResponse(
                    serving.stream_chat(
                        dep,
                        req,
                        call_id,
                        tid,
                        prompt_ids,
                        params,
                        constraint,
                        messages,
                        ids,
                        created,
                        reply,
                        parse_calls,
                    ),
                    media_type="text/event-stream",
                    headers=headers,
                )
            future = serving.submit(
                dep, prompt_ids, params, req.stop, constraint, stop_ids=chat_format.stop_ids
            )
        try:
            c, seed = await asyncio.wrap_future(future)
        except ConstraintError as e:  # the request's grammar failed mid-way: nothing was recorded
            raise ParamError("response_format", str(e)) from e
        message, finish, logprobs = reply(c)
        metrics.counts["chat"] += 1
        ids["token_ids"] = c.token_ids
        response = JSONResponse(
            {
                "id": f"chatcmpl-{call_id}",
                "object": "chat.completion",
                "created": created,
                "model": dep.deployment_id,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
                "usage": usage(prompt_ids, c),
                "prodrl": ids,
            },
            headers=headers,
        )
        if await request.is_disconnected():  # nobody will receive it: not recorded
            metrics.counts["client_gone"] += 1
            return response
        await serving.record(dep, call_id, tid, prompt_ids, c, params, seed, messages + [message])
        return response

    @app.post("/v1/completions")
    async def completions(
        request: Request, req: CompletionRequest, x_prodrl_trajectory_id: str | None = Header(None)
    ):
        room()
        req.check()
        if req.model is not None and req.model not in serving.names():
            return model_error(req.model)
        if req.stream:
            raise ParamError("stream", "stream is supported on /v1/chat/completions only")
        call_id = uuid.uuid4().hex
        tid = serving.open_trajectory(req, x_prodrl_trajectory_id, call_id)
        prompt_ids = (
            list(req.prompt)
            if isinstance(req.prompt, list)
            else await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=False)
        )
        with serving.leased(tid, req.model) as dep:
            params = serving.sampling(dep, prompt_ids, req, "prompt")
            future = serving.submit(dep, prompt_ids, params, req.stop)
        c, seed = await asyncio.wrap_future(future)
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
                    dict(zip(tok(ids[: req.logprobs].tolist()), lps[: req.logprobs].tolist(), strict=True))
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
                "model": dep.deployment_id,
                "choices": [choice],
                "usage": usage(prompt_ids, c),
                "prodrl": ids,
            },
            headers=id_headers(tid, call_id),
        )
        if await request.is_disconnected():
            metrics.counts["client_gone"] += 1
            return response
        await serving.record(
            dep, call_id, tid, prompt_ids, c, params, seed, {"prompt": req.prompt, "completion": text}
        )
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
