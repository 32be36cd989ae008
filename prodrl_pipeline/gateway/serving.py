"""What serving a call involves, apart from HTTP: the gateway's settings and metrics, a call's
trajectory, its checked sampling parameters, the engine request (per-token hooks, constraints), its
record in the landing log, and the body of a streamed chat call."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote, unquote

from fastapi import HTTPException
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.constraints import Constraint
from prodrl_pipeline.engine.grammar import GrammarConstraint
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Completion
from prodrl_pipeline.engine.rows import Request as EngineRequest
from prodrl_pipeline.gateway.chat_format import chat_format
from prodrl_pipeline.gateway.deployments import Deployments, LiveFollower, Loaded
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.gateway.protocol import ChatRequest, ParamError, SamplingFields
from prodrl_pipeline.gateway.responses import Ending, TokenFeed, chat_stream, stop_at, usage
from prodrl_pipeline.gateway.sessions import EXPIRED_TABLE, SessionIndex
from prodrl_pipeline.records import support

TRAJECTORY_HEADER, CALL_HEADER = "X-Prodrl-Trajectory-Id", "X-Prodrl-Call-Id"
HEADER_ID_BYTES = 2048  # a longer escaped id is left out of the response header (proxies' header buffers)
BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def id_headers(tid: str, call_id: str) -> dict[str, str]:
    """A response's id headers: the trajectory id percent-encoded as UTF-8 (every byte but
    A-Z a-z 0-9 - . _ ~ : as %XX; `urllib.parse.unquote` decodes it), left out when that is over
    HEADER_ID_BYTES (the body's `prodrl.trajectory_id` always carries the id)."""
    headers = {CALL_HEADER: call_id}
    if len(escaped := quote(tid, safe=":")) <= HEADER_ID_BYTES:
        headers[TRAJECTORY_HEADER] = escaped
    return headers


def header_id(value: str) -> str:
    """The trajectory id a request's header names: ASCII with percent-escapes of UTF-8, decoded (the
    response header's own form, so it can be sent back as it came); 400 otherwise."""
    if not value.isascii() or BAD_ESCAPE.search(value):
        raise HTTPException(400, f"{TRAJECTORY_HEADER}: percent-encode the id as UTF-8 (a % starts %XX)")
    try:
        return unquote(value, errors="strict")
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"{TRAJECTORY_HEADER}: its escapes are not UTF-8") from e


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway serves and records."""

    model_aliases: tuple[str, ...] = ("live",)
    """Names a request's `model` may give for the current deployment (besides loaded ids)."""
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
    moved: int = 0
    """Calls served by another deployment than their trajectory's first (it had drained)."""

    def render(self, gauges: dict[str, float]) -> str:
        lines = [
            f'prodrl_gateway_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.counts.items())
        ]
        lines += [f"prodrl_gateway_{k} {v}" for k, v in gauges.items()]
        return "\n".join(lines) + "\n"


class Serving:
    """The deployments, tokenizer (and the chat format it serves: `gateway.chat_format`), landing
    log and sessions one gateway serves with; `follower` (when set) moves the deployments along the
    registry's live pointer."""

    def __init__(
        self,
        cfg: GatewayConfig,
        deployments: Deployments,
        tokenizer: PreTrainedTokenizerBase,
        landing: LandingLog | None,
        sessions: SessionIndex,
        follower: LiveFollower | None = None,
    ):
        self.cfg, self.deployments, self.tokenizer = cfg, deployments, tokenizer
        self.landing, self.sessions, self.follower = landing, sessions, follower
        self.chat = chat_format(tokenizer)
        self.metrics = Metrics()

    def names(self) -> list[str]:
        """What a request's `model` may name: loaded deployment ids (once each: a re-exported one
        drains beside its new export), then the aliases."""
        return list(dict.fromkeys([*self.deployments.ids(), *self.cfg.model_aliases]))

    @contextlib.contextmanager
    def leased(self, tid: str, model: str | None) -> Iterator[Loaded]:
        """The deployment serving this call (docs: gateway.md; a new trajectory's first call may be
        routed by a canary), held open until the block ends: end it once the call is submitted to
        the deployment's engine."""
        pinned = self.sessions.pinned(tid)
        named = None if model in self.cfg.model_aliases else model
        route = self.deployments.acquire(named, pinned, tid if pinned is None else None)
        loaded = route.loaded
        try:
            self.sessions.pin(tid, loaded.deployment_id, route.arm)
            self.metrics.moved += pinned is not None and pinned != loaded.deployment_id
            yield loaded
        finally:
            self.deployments.release(loaded)

    def open_trajectory(self, req: SamplingFields, header: str | None, call_id: str) -> str:
        """The call's trajectory id, refused (409) when that trajectory expired unscored."""
        tid = self.trajectory_of(req, header, call_id)
        if self.sessions.is_expired(tid):
            raise HTTPException(
                409,
                f"trajectory {tid!r} expired unscored (TTL {self.sessions.ttl:g} s); "
                "start a new trajectory id",
            )
        return tid

    @staticmethod
    def trajectory_of(req: SamplingFields, header: str | None, call_id: str) -> str:
        """The first non-empty of the header (decoded), `metadata.trajectory_id` and `user`, exactly
        as given: kept as data (headers carry it escaped), else the call id."""
        given = (header_id(header) if header else None, (req.metadata or {}).get("trajectory_id"), req.user)
        return next((tid for tid in given if tid), call_id)

    def sampling(
        self, dep: Loaded, prompt_ids: list[int], req: SamplingFields, prompt_param: str
    ) -> SamplingParams:
        """The call's sampling parameters, once the prompt and every parameter are checked against
        the deployment's model and engine (ParamError otherwise)."""
        engine = dep.engine.engine
        room = dep.max_positions - len(prompt_ids)
        asked = req.max_completion_tokens or req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            wanted = f" + max_tokens ({asked})" if asked is not None else ""
            raise ParamError(
                prompt_param if asked is None else "max_tokens",
                f"the prompt ({len(prompt_ids)} tokens){wanted} exceeds the {dep.max_positions} positions",
            )
        vocab = engine.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ParamError(prompt_param, f"prompt token ids must be in [0, {vocab})")
        if req.stop and "on_token" not in engine.honours:
            raise ParamError("stop", "stop strings are not supported by this gateway's engine yet")
        shown = getattr(req, "top_logprobs", None) or getattr(req, "logprobs", None)
        if isinstance(shown, int) and not isinstance(shown, bool) and shown > engine.top_logprobs:
            param = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
            raise ParamError(param, f"this gateway records the top {engine.top_logprobs} log-probs")
        bias = tuple(sorted((int(t), float(b)) for t, b in (req.logit_bias or {}).items()))
        if bias and "logit_bias" not in engine.honours:
            raise ParamError("logit_bias", "logit_bias is not supported by this gateway's engine yet")
        if any(t >= vocab for t, _ in bias):
            raise ParamError("logit_bias", f"logit_bias token ids must be in [0, {vocab})")
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=asked or min(self.cfg.default_max_tokens, room),
            seed=req.seed,
            logit_bias=bias,
        )

    def submit(
        self,
        dep: Loaded,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str] | None,
        constraint: Constraint | None = None,
        observe: Callable[[list[int]], bool] | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> Future:
        """Queue one completion: a future of (Completion, recorded seed). `observe` sees the ids
        after every token on the engine thread; it or a stop string returning True ends it, as
        does a token of `stop_ids` (the chat format's: harmony's <|return|> and <|call|>)."""
        hooks = [h for h in (observe, stop_at(self.tokenizer, stops) if stops else None) if h]
        on_token = (lambda ids: any([h(ids) for h in hooks])) if hooks else None  # noqa: E731 - every hook sees every token
        request = EngineRequest(
            prompt_ids, params, constraint=constraint, on_token=on_token, stop_ids=stop_ids
        )
        return dep.engine.submit(request)

    async def record(
        self,
        dep: Loaded,
        call_id: str,
        tid: str,
        prompt_ids: list[int],
        c: Completion,
        params: SamplingParams,
        seed: int,
        messages: list[dict] | dict,
    ) -> None:
        """Index the call in its session, then make its record durable; the spool write (with its
        schema check and serialization) runs off the event loop, the caller answers after it."""
        index = self.sessions.next_call_index(tid)
        extends = self.sessions.follow(tid, prompt_ids, c.token_ids)
        if extends is not None:
            self.metrics.prefix["extends" if extends else "breaks"] += 1
        if not (self.landing and self.cfg.record):
            return
        arm = self.sessions.arm(tid, dep.deployment_id)
        await asyncio.to_thread(
            self.landing.append,
            "call",
            {
                "call_id": call_id,
                "trajectory_id": tid,
                "call_index": index,
                "deployment_id": dep.deployment_id,
                "canary_id": arm and arm.canary_id,
                "arm": arm and arm.name,
                "prompt_token_ids": prompt_ids,
                "completion_token_ids": c.token_ids,
                "completion_logprobs": c.logprobs,
                "topk_token_ids": c.topk_ids,
                "topk_logprobs": c.topk_logprobs,
                **support.columns(c.supports),
                "extra_token_ids": c.extra_ids,
                "vocab_size": dep.engine.engine.vocab_size,
                "grammar": c.grammar,
                "sampling": params.recorded(seed),
                "finish_reason": c.finish_reason,
                "messages_json": json.dumps(messages),
                "created_at": datetime.now(UTC),
            },
        )

    async def constraint(self, dep: Loaded, req: ChatRequest) -> Constraint | None:
        """The structured output a chat call asks for: JSON (`response_format`), or the call
        `tool_choice` required or named asks for (None for auto and none: as vLLM does, `none`
        keeps the tools in the prompt and returns the text as content). Compiled off the loop."""
        fmt, choice = req.response_format, req.tool_choice
        if fmt is not None and fmt.type != "text":
            if not self.chat.serves_json:
                raise ParamError(
                    "response_format", "JSON replies are not supported for this model's chat format yet"
                )
            if "response_format" not in dep.engine.engine.honours:
                raise ParamError("response_format", "JSON replies are not supported by this engine yet")
            schema = fmt.json_schema.schema_ if fmt.json_schema else None
            try:
                return await asyncio.to_thread(
                    GrammarConstraint.json, self.tokenizer, self.tokenizer.eos_token_id, schema
                )
            except ValueError as e:
                raise ParamError("response_format", str(e)) from e
        if choice is None or choice in ("none", "auto"):
            return None
        if "tool_choice" not in dep.engine.engine.honours:
            raise ParamError(
                "tool_choice", "required or named tool calls are not supported by this engine yet"
            )
        if req.stop:
            raise ParamError("stop", "stop cannot cut a required tool call")
        name = None if choice == "required" else choice.function.name
        try:
            return await asyncio.to_thread(self.chat.forced_call, req.tools, name)
        except ValueError as e:
            raise ParamError("tool_choice", str(e)) from e

    def stream_chat(
        self,
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
    ):  # noqa: ANN001, ANN202, PLR0913
        """The SSE body of a streamed chat call: tokens as the engine produces them (an engine
        without per-token callbacks streams its finished completion); the call is recorded when
        its completion is done, before the last chunks; a client that leaves ends the generation
        at the next token and nothing is recorded."""
        tokens = TokenFeed(asyncio.get_running_loop())
        gone = threading.Event()
        live = "on_token" in dep.engine.engine.honours

        def observe(ids_so_far: list[int]) -> bool:
            try:
                tokens.put((len(ids_so_far), ids_so_far[-1]))
            except RuntimeError:  # the event loop is gone (shutdown): end the generation
                return True
            return gone.is_set()

        future = self.submit(
            dep, prompt_ids, params, req.stop, constraint, observe if live else None, self.chat.stop_ids
        )

        def finished(f: Future) -> None:
            done = [] if live or f.cancelled() or f.exception() else f.result()[0].token_ids
            with contextlib.suppress(RuntimeError):  # a closed loop has no stream left to feed
                for n, t in enumerate(done, 1):
                    tokens.put((n, t))
                tokens.put(None)

        future.add_done_callback(finished)

        async def end() -> Ending:
            if future.exception():  # an engine error surfaces here, before anything is recorded
                self.metrics.counts["engine_error"] += 1
            c, seed = future.result()
            message, finish, logprobs = reply(c)
            await self.record(dep, call_id, tid, prompt_ids, c, params, seed, messages + [message])
            self.metrics.counts["chat"] += 1
            ids["token_ids"] = c.token_ids
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return Ending(message, finish, logprobs, usage(prompt_ids, c) if include_usage else None)

        def abandon() -> None:
            gone.set()  # ends a running generation at its next token
            future.cancel()  # or drops a queued one
            self.metrics.counts["client_gone"] += 1

        return chat_stream(
            self.tokenizer,
            dep.deployment_id,
            call_id,
            created,
            ids,
            tokens,
            end,
            abandon,
            stops=req.stop,
            call_starts=self.chat.stream_hold(parse_calls),
        )


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
