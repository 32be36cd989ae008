"""What every request passes before the gateway reads its body (an ASGI middleware).

Order: the API key from the headers (401; /healthz is open, /v1/feedback takes the feedback keys,
every other path the serving keys), then the declared length (413), then the body itself, counted
while it is read (413 as soon as it passes the limit, chunked bodies included). Nothing of an
unauthenticated body is read, nor more than the limit of any body.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from prodrl_pipeline.gateway.errors import error_body

OPEN_PATHS = frozenset({"/healthz"})
FEEDBACK_PATH = "/v1/feedback"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def authorized(header: bytes, keys: tuple[str, ...]) -> bool:
    """`Authorization: Bearer <key>` with one of `keys` (scheme case-insensitive, keys compared in
    constant time); anything goes when no key is configured."""
    if not keys:
        return True
    scheme, _, given = header.partition(b" ")
    return scheme.lower() == b"bearer" and any(hmac.compare_digest(given.strip(), k.encode()) for k in keys)


CODES = {401: "invalid_api_key", 413: "request_too_large"}


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message, code=CODES.get(status)))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),  # a refused client gets no connection to keep streaming into
            ],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})


class Guard:
    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        serve_keys: tuple[str, ...],
        feedback_keys: tuple[str, ...],
        max_body_bytes: int,
        count: Callable[[str], None],
    ) -> None:
        self.app, self.serve_keys, self.feedback_keys = app, serve_keys, feedback_keys
        self.max_body_bytes, self.count = max_body_bytes, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["path"] not in OPEN_PATHS:
            keys = self.feedback_keys if scope["path"] == FEEDBACK_PATH else self.serve_keys
            if not authorized(headers.get(b"authorization", b""), keys):
                self.count("401")
                return await _refuse(send, 401, "missing or wrong API key")
        length = headers.get(b"content-length")
        if length is not None and not length.isdigit():
            self.count("400")
            return await _refuse(send, 400, "invalid content-length header")
        if length is not None and int(length) > self.max_body_bytes:
            self.count("413")
            return await _refuse(send, 413, f"request body over {self.max_body_bytes} bytes")
        seen, refused = 0, False

        async def bounded() -> Message:
            """The body as the app reads it; past the limit: answer 413 and tell the app the
            client left (it stops reading and its own answer is dropped)."""
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                refused = True
                self.count("413")
                await _refuse(send, 413, f"request body over {self.max_body_bytes} bytes")
                return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            if not refused:
                await send(message)

        return await self.app(scope, bounded, unless_refused)
