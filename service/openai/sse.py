"""Server-sent events as OpenAI streams them: `data: <json>` per chunk, `data: [DONE]` last.

Once the stream's 200 is sent, a failure can only be an event: `data: {"error": {...}}` (the
error object of a failed request, as vLLM sends it), then `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from service.openai.errors import ERROR_TYPES

DONE = b"data: [DONE]\n\n"


def data(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def error_event(status: int, message: str) -> bytes:
    error = {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status}
    return data({"error": error})


def stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    """The response that sends `events`. A client that disconnects cancels the iterator
    (Starlette cancels the streaming task), which cancels the requests behind it."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
