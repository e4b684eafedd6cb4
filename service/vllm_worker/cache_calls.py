"""The worker protocol's calls on the prefix cache: SubscribeKvEvents and FlushCache.

A mixin of VllmEngineServicer, which provides `self.engine` (the EngineClient) and
`self.generation` (the GenerationServicer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from service.vllm_worker.pb import common_pb2


class CacheCalls:
    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV events are not published yet")
        yield common_pb2.KvEventBatch()  # not reached: abort raises

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "FlushCache is not served yet")
        raise AssertionError("not reached: abort raises")
