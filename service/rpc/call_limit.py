"""CallLimit: a bound on the Generation calls the server runs at once.

A call over the bound ends at once with RESOURCE_EXHAUSTED and google.rpc.RetryInfo, and is
logged. Without this bound a burst piles up in gRPC core, which sheds what it cannot queue by
cancelling calls before they reach a handler: the caller sees CANCELLED and nothing is logged.

The vLLM worker protocol's calls count as Generation's do. Health, reflection and Admin are not
counted (probes and operators must get through an overload), nor are Generation's Cancel and
the worker protocol's Abort, which free capacity rather than take it, nor the gateway's own
probes and feeds: HealthCheck, GetLoads (it routes by them, overload included) and
SubscribeKvEvents (one call that lasts as long as the gateway watches the worker).

GenerateStream calls are also counted per connection (gRPC's peer address): a call lasts as long
as its caller likes, so one connection holding `per_connection` of them is refused another,
and cannot take every slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from service.rpc.handlers import rewrap
from service.rpc.refusal import Refusal

log = structlog.get_logger("sluice.call_limit")

LIMITED_PREFIXES = ("/sluice.v1.Generation/", "/vllm.grpc.engine.VllmEngine/")
EXEMPT_METHODS = frozenset(
    {
        "/sluice.v1.Generation/Cancel",
        *(
            f"/vllm.grpc.engine.VllmEngine/{name}"
            for name in ("Abort", "HealthCheck", "GetLoads", "SubscribeKvEvents")
        ),
    }
)
PER_CONNECTION_METHOD = "/sluice.v1.Generation/GenerateStream"


class CallLimit(grpc.aio.ServerInterceptor):
    """Counts the limited calls that are running; refuses a new one when `limit` are.

    A call takes its slot when its handler starts and gives it back when the handler ends, by
    any path: done, refused, failed (a request that does not parse included), or cancelled
    because the client left.
    """

    def __init__(self, limit: int, retry_after: float, per_connection: int | None = None) -> None:
        assert limit >= 1
        self.limit = limit
        self.retry_after = retry_after
        self.per_connection = limit if per_connection is None else per_connection
        self.in_use = 0  # limited calls whose handler is running now
        self.refused = 0  # calls refused since start
        self.streams: dict[str, int] = {}  # peer -> its GenerateStream calls running now

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(LIMITED_PREFIXES) or method in EXEMPT_METHODS:
            return handler
        return self._counted(handler, method)

    def _take(self, method: str, peer: str | None) -> grpc.Status | None:
        """Take a slot (and the connection's, for a `peer`), or return the status that refuses
        the call. No await: the checks and the increments are one step on the event loop."""
        if peer is not None and self.streams.get(peer, 0) >= self.per_connection:
            return self._refuse(
                method,
                f"this connection is running its limit of {self.per_connection} GenerateStream "
                "calls (--max-generate-streams-per-connection)",
            )
        if self.in_use >= self.limit:
            return self._refuse(
                method,
                f"the server is running its limit of {self.limit} calls (--max-concurrent-rpcs)",
            )
        self.in_use += 1
        if peer is not None:
            self.streams[peer] = self.streams.get(peer, 0) + 1
        return None

    def _refuse(self, method: str, message: str) -> grpc.Status:
        self.refused += 1
        log.warning(
            "request.refused",
            code="RESOURCE_EXHAUSTED",
            method=method,
            message=message,
            refused=self.refused,
        )
        refusal = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after=self.retry_after)
        return refusal.to_status()

    def _release(self, peer: str | None) -> None:
        assert self.in_use > 0
        self.in_use -= 1
        if peer is not None:
            left = self.streams.pop(peer) - 1
            if left:
                self.streams[peer] = left

    def _counted(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """A handler of the same streaming kind as `handler` that holds a slot while it runs.

        Streaming responses must come from an async generator (as every Generation handler
        does), not from `context.write`."""

        def unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
                refusal = self._take(method, None)
                if refusal is not None:
                    await context.abort_with_status(refusal)
                try:
                    return await inner(request, context)
                finally:
                    self._release(None)

            return behavior

        def streaming(
            inner: Callable[..., AsyncIterator[Any]],
        ) -> Callable[..., AsyncIterator[Any]]:
            async def behavior(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                peer = context.peer() if method == PER_CONNECTION_METHOD else None
                refusal = self._take(method, peer)
                if refusal is not None:
                    await context.abort_with_status(refusal)
                try:
                    # NOTE: a client that leaves cancels the task iterating this generator;
                    # the CancelledError passes through here and `finally` gives the slot back.
                    async for response in inner(request, context):
                        yield response
                finally:
                    self._release(peer)

            return behavior

        return rewrap(handler, unary, streaming)
