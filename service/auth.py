"""BearerTokenInterceptor: the optional API token for the Generation service."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

# Health checks and reflection stay open: load balancers and grpcurl probe them without tokens.
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>`: missing is UNAUTHENTICATED, wrong is
    PERMISSION_DENIED. The token is compared in constant time and never logged."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        presented = metadata.get("authorization")
        if presented is None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        if isinstance(presented, str):
            presented = presented.encode()
        if not hmac.compare_digest(presented, self._expected):
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, "invalid bearer token")
        return handler


def _refusing(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that ends the call with `code`."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def abort_streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    des, ser = handler.request_deserializer, handler.response_serializer
    match handler.request_streaming, handler.response_streaming:
        case False, False:
            return grpc.unary_unary_rpc_method_handler(abort, des, ser)
        case False, True:
            return grpc.unary_stream_rpc_method_handler(abort_streaming, des, ser)
        case True, False:
            return grpc.stream_unary_rpc_method_handler(abort, des, ser)
        case _:
            return grpc.stream_stream_rpc_method_handler(abort_streaming, des, ser)
