"""Gate: what every HTTP request passes before a route sees it (an ASGI middleware).

1. The bearer token: with an API token configured, every path but /health needs
   `Authorization: Bearer <token>` (compared in constant time, never logged); missing or wrong
   is 401 (OpenAI answers an invalid key 401), more than one Authorization header too.
2. The body's size: at most `max_body_bytes` (--max-message-bytes, sluice.v1's bound on a
   request message). A declared Content-Length above it is refused 413 before a byte is read;
   a chunked body is read up to the bound and refused 413 as soon as it passes it. What a
   route then parses is the body buffered here.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.openai.errors import ERROR_TYPES

OPEN_PATHS = frozenset({"/health"})


class Gate:
    def __init__(self, app: ASGIApp, api_token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self._token = None if api_token is None else f"Bearer {api_token}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._token is not None and scope["path"] not in OPEN_PATHS:
            presented = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(presented) != 1 or not hmac.compare_digest(presented[0], self._token):
                why = (
                    "more than one Authorization header"
                    if len(presented) > 1
                    else ("missing or invalid API key: send 'Authorization: Bearer <the token>'")
                )
                await _refuse(send, 401, why, "invalid_api_key")
                return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _refuse(send, 413, self._too_large(), "request_too_large")
            return
        body = await self._read(receive)
        if body is None:
            await _refuse(send, 413, self._too_large(), "request_too_large")
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes (--max-message-bytes)"

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the bound."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)  # a disconnect: the route sees a short body
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_body_bytes:
                return None
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body once, then the connection's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    error: dict[str, Any] = {
        "message": message,
        "type": ERROR_TYPES.get(status, "invalid_request_error"),
        "param": None,
        "code": code,
    }
    payload = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    if status == 413:
        headers.append((b"connection", b"close"))  # the rest of the body is not read
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
