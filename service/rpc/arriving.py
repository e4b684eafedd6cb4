"""arriving_within: a client stream whose caller must keep sending (UpdateWeights and
LoadAdapterStream, under --update-idle-timeout): a stalled caller must not hold what its call
holds (the update slot, a spool on disk)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

from service.rpc.refusal import Refusal

Message = TypeVar("Message")


async def arriving_within(
    messages: AsyncIterator[Message], timeout: float, what: str = "update"
) -> AsyncIterator[Message]:
    """`messages`, as long as each (or the end of the stream) arrives within `timeout` seconds
    of the one before; then Refusal ABORTED, saying the `what` was abandoned."""
    iterator = aiter(messages)
    while True:
        try:
            message = await asyncio.wait_for(anext(iterator), timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Refusal(
                grpc.StatusCode.ABORTED,
                f"the {what} was abandoned: no message from the caller for {timeout:g} s "
                "(--update-idle-timeout)",
            ) from None
        yield message
