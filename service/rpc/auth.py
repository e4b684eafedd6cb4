"""BearerTokenInterceptor: the API token for Generation and the admin token for Admin.

Tokens travel as `authorization: Bearer <token>` metadata. They are compared in constant time
(hmac.compare_digest) and never logged. A call that needs a token and carries more than one
`authorization` entry is UNAUTHENTICATED: which one counts must not depend on the order a proxy
or a client library happens to keep.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

# Health checks and reflection stay open: load balancers and grpcurl probe them without tokens.
# The vLLM worker protocol's HealthCheck answers like grpc.health: the SMG gateway probes it
# without the key it sends with every other call, and it tells no more than health does.
OPEN_PREFIXES = (
    "/grpc.health.v1.",
    "/grpc.reflection.",
    "/vllm.grpc.engine.VllmEngine/HealthCheck",
)
ADMIN_PREFIX = "/sluice.v1.Admin/"
MANY_TOKENS = "more than one authorization metadata entry: send exactly one"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Checks the token a call presents against the one its service needs.

    Generation (and anything else not open): with an API token configured, missing is
    UNAUTHENTICATED and wrong is PERMISSION_DENIED; without one, calls pass.
    Admin: with no admin token configured, every call is PERMISSION_DENIED (the service is
    off); a missing or wrong token is UNAUTHENTICATED (it does not prove the caller an admin).
    """

    def __init__(self, api_token: str | None = None, admin_token: str | None = None) -> None:
        self._api = None if api_token is None else _bearer(api_token)
        self._admin = None if admin_token is None else _bearer(admin_token)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        entries = _presented(handler_call_details)
        presented = entries[0] if len(entries) == 1 else None
        if method.startswith(ADMIN_PREFIX):
            if self._admin is None:
                return _refusing(
                    handler,
                    grpc.StatusCode.PERMISSION_DENIED,
                    "the Admin service is disabled: the server has no admin token",
                )
            if len(entries) > 1:
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, MANY_TOKENS)
            if presented is None or not hmac.compare_digest(presented, self._admin):
                return _refusing(
                    handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid admin token"
                )
            return handler
        if self._api is None:
            return handler
        if len(entries) > 1:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, MANY_TOKENS)
        if presented is None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        if not hmac.compare_digest(presented, self._api):
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, "invalid bearer token")
        return handler


def _bearer(token: str) -> bytes:
    return f"Bearer {token}".encode()


def _presented(details: grpc.HandlerCallDetails) -> list[bytes]:
    """Every `authorization` entry of the call's metadata, in order."""
    return [
        value.encode() if isinstance(value, str) else value
        for key, value in details.invocation_metadata or ()
        if key == "authorization"
    ]


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
