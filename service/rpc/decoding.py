"""DecodingInterceptor: a request message that does not parse is INVALID_ARGUMENT.

grpc parses each request message with the method's deserializer before the servicer sees it;
one that fails (invalid UTF-8 in a string field, corrupt bytes) would end the call UNKNOWN
("Unexpected DecodeError"). For every method of the sluice.v1 services and of the vLLM worker
protocol (vllm.grpc.engine), this interceptor
installs a handler that receives the raw bytes and parses them itself:
- a single request message that does not parse ends the call INVALID_ARGUMENT at once;
- in a request stream, reading a message that does not parse raises `UndecodableMessage` (a
  `Refusal`, INVALID_ARGUMENT) in the servicer, which ends the call its own way (GenerateStream
  first finishes the requests it admitted).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.rpc.refusal import Refusal

PREFIXES = ("/sluice.v1.", "/vllm.grpc.engine.")

Parse = Callable[[bytes], Any]


class UndecodableMessage(Refusal):
    """A request message that is not a valid serialized message of the method's request type."""

    def __init__(self, method: str, index: int | None, error: DecodeError) -> None:
        which = "the request message" if index is None else f"request message {index}"
        super().__init__(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{which} of {method} could not be parsed ({error}): corrupt bytes, or a string "
            "field that is not valid UTF-8",
        )


class DecodingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if (
            handler is None
            or not method.startswith(PREFIXES)
            or handler.request_deserializer is None
        ):
            return handler
        return _parsing(handler, method)


def _parsing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` fed raw bytes, which it parses with the deserializer it had."""
    parse: Parse = handler.request_deserializer
    serialize = handler.response_serializer

    async def parse_or_abort(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            await context.abort_with_status(UndecodableMessage(method, None, exc).to_status())

    async def parsed(raw_messages: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        index = 0
        async for raw in raw_messages:
            try:
                message = parse(raw)
            except DecodeError as exc:
                raise UndecodableMessage(method, index, exc) from exc
            index += 1
            yield message

    match handler.request_streaming, handler.response_streaming:
        case False, False:
            behavior = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(await parse_or_abort(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, serialize)
        case False, True:
            behavior = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                request = await parse_or_abort(raw, context)
                async with contextlib.aclosing(_responses(behavior(request, context))) as out:
                    async for response in out:
                        yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, None, serialize)
        case True, False:
            behavior = handler.stream_unary

            async def stream_unary(
                raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext
            ) -> Any:
                return await behavior(parsed(raw), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, None, serialize)
        case _:
            behavior = handler.stream_stream

            async def stream_stream(
                raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext
            ) -> Any:
                async with contextlib.aclosing(_responses(behavior(parsed(raw), context))) as out:
                    async for response in out:
                        yield response

            return grpc.stream_stream_rpc_method_handler(stream_stream, None, serialize)


async def _responses(result: Any) -> AsyncGenerator[Any, None]:
    """The responses of a response-streaming behavior: an async generator's items, or none
    when it is a coroutine that writes them with `context.write`. Closing this closes the
    behavior's generator at once (its cleanup, e.g. aborting a request, runs then)."""
    if inspect.isasyncgen(result):
        async with contextlib.aclosing(result):
            async for response in result:
                yield response
    else:
        await result
