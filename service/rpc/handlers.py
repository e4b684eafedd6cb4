"""Rewrapping a gRPC method handler's behavior, for the server interceptors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def rewrap(handler: grpc.RpcMethodHandler, unary: Wrap, streaming: Wrap) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` whose behavior is wrapped: by `unary` when it
    returns one response, by `streaming` when it yields a stream of them."""
    des, ser = handler.request_deserializer, handler.response_serializer
    match handler.request_streaming, handler.response_streaming:
        case False, False:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), des, ser)
        case False, True:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), des, ser)
        case True, False:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), des, ser)
        case _:
            return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), des, ser)
