"""CallMetrics: counts every gRPC call by method and final status code.

Installed first among the server's interceptors, so it also sees the calls the others refuse
(a missing token, the call limit, a message that does not parse). A call is counted once, when
its handler ends: for a streaming call that is after its last message, also when the client
cancelled it (CANCELLED, or DEADLINE_EXCEEDED when its deadline had passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.ops.metrics import UNKNOWN_METHOD, Metrics
from service.rpc.handlers import rewrap


class CallMetrics(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            # NOTE: the caller chooses the name: labelling by it would let anyone add series.
            self.metrics.grpc_call_ended(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED.name)
            return handler
        return _counted(handler, handler_call_details.method, self.metrics)


def _final_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status a handler that returned, or raised `error`, ends its call with."""
    if isinstance(error, asyncio.CancelledError):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return "DEADLINE_EXCEEDED" if expired else "CANCELLED"
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return "UNKNOWN"  # what grpc.aio sends for an exception a handler did not handle
    code = context.code()  # set by abort() or set_code(); None when the handler never set one
    return "OK" if code is None else code.name


def _counted(
    handler: grpc.RpcMethodHandler, method: str, metrics: Metrics
) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that counts the call when it ends."""

    def unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                response = await inner(request, context)
            except BaseException as exc:
                metrics.grpc_call_ended(method, _final_code(context, exc))
                raise
            metrics.grpc_call_ended(method, _final_code(context, None))
            return response

        return behavior

    def streaming(inner: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(inner):
            # It sends its responses with context.write (the health Watch does); grpc.aio
            # tells the two kinds apart by the function, so the wrapper must be of its kind.
            return unary(inner)

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async with contextlib.aclosing(inner(request, context)) as out:
                    async for response in out:
                        yield response
            except BaseException as exc:
                metrics.grpc_call_ended(method, _final_code(context, exc))
                raise
            metrics.grpc_call_ended(method, _final_code(context, None))

        return behavior

    return rewrap(handler, unary, streaming)
