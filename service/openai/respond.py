"""An answer (completions' or chat's) sent whole or as a stream of server-sent events.

A whole answer whose choice failed (the engine's ERROR, lost engine, deadline) is that
failure's error instead; a stream sends its chunks, then the failure as an error event, or
the usage chunk when `stream_options.include_usage` asked for it, then `[DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
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


async def respond(answer: Answer) -> Response:
    if answer.request.stream:
        return sse.stream(_stream(answer))
    events = await answer.fanout.collect()
    body = answer.body(events)
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
