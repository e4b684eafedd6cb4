"""An answer (completions' or chat's) sent whole or as a stream of server-sent events.

A whole answer whose client disconnects has its requests cancelled; one whose choice failed (the engine's ERROR, lost engine, deadline) is that
failure's error instead; a stream sends its chunks, then the failure as an error event, or
the usage chunk when `stream_options.include_usage` asked for it, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response

from service.openai import sse
from service.openai.choices import Choices
from service.openai.errors import error_response
from service.openai.fanout import Event, FanOut
from service.openai.schemas import Sampling


class Answer(Protocol):
    @property
    def request(self) -> Sampling: ...

    @property
    def fanout(self) -> FanOut: ...

    @property
    def choices(self) -> Choices: ...

    def chunks(self, event: Event) -> list[dict[str, Any]]: ...

    def usage_chunk(self) -> dict[str, Any]: ...

    def body(self, events: list[Event]) -> dict[str, Any]: ...


async def respond(
    answer: Answer, disconnected: Callable[[], Coroutine[Any, Any, None]]
) -> Response:
    """`disconnected` returns once the client has gone: a whole answer's requests are then
    cancelled, as a stream's are when Starlette cancels it."""
    if answer.request.stream:
        return sse.stream(_stream(answer))
    collecting = asyncio.create_task(answer.fanout.collect(), name="openai-collect")
    watching = asyncio.create_task(disconnected(), name="openai-disconnect")
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()  # the client left (or this handler was cancelled)
        await asyncio.gather(collecting, watching, return_exceptions=True)
    if collecting.cancelled():
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    body = answer.body(collecting.result())
    if (failure := answer.choices.failure()) is not None:
        return error_response(*failure)
    return JSONResponse(body)


async def _stream(answer: Answer) -> AsyncIterator[bytes]:
    events = answer.fanout.events()
    try:
        async for event in events:
            for chunk in answer.chunks(event):
                yield sse.data(chunk)
            if (failure := answer.choices.failure()) is not None:
                yield sse.error_event(*failure)
                break
        else:
            if answer.request.include_usage():
                yield sse.data(answer.usage_chunk())
    finally:
        await events.aclose()
    yield sse.DONE
