"""The worker protocol's calls on the prefix cache: SubscribeKvEvents and FlushCache.

A mixin of VllmEngineServicer, which provides `self.engine` (the EngineClient). The events
are the engine's own (engine/protocol/kv_events.py), numbered and kept by the EngineClient's
KvEventLog (service/engine_link/kv_event_log.py); here they become `KvEventBatch` messages.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from engine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from service.engine_link.engine_process import EngineUnavailableError
from service.engine_link.kv_event_log import CursorExpired, KvEventBatch, SubscriberTooSlow
from service.vllm_worker.pb import common_pb2

if TYPE_CHECKING:
    from service.engine_link.engine_client import EngineClient


class CacheCalls:
    engine: EngineClient

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches after `start_sequence_number` (0: the whole history if it reaches back to
        the first batch, else from now), then live ones as they come, until the caller leaves.
        OUT_OF_RANGE: the history no longer holds that cursor (the gateway then clears the
        worker and subscribes from 0); DATA_LOSS: the caller read too slowly and batches it
        had not read left the history."""
        try:
            subscription = self.engine.kv_events.subscribe(request.start_sequence_number)
        except CursorExpired as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        # NOTE: at once: the gateway gives a worker 2 s to answer with headers, or vetoes it.
        await context.send_initial_metadata(())
        while True:
            try:
                batches = await subscription.next()
            except SubscriberTooSlow as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
            info = self.engine.info
            page_size = info.page_size if info is not None else 0
            for batch in batches:
                yield batch_proto(batch, page_size)

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Forget the prefix cache now, whatever `timeout_s` allows: a flush waits for no
        request, since running ones keep their pages (docs/service.md)."""
        if not math.isfinite(request.timeout_s) or request.timeout_s < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "timeout_s: must be finite and not negative"
            )
        try:
            flushed = await self.engine.calls.flush_cache()
        except EngineUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the cache was not flushed: {exc}")
        if flushed.error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, flushed.error)
        return common_pb2.FlushCacheResponse(
            success=True,
            message=f"prefix cache flushed: {flushed.pages_freed} cached pages freed",
        )


def batch_proto(batch: KvEventBatch, page_size: int) -> common_pb2.KvEventBatch:
    """One logged batch as the protocol's message: a block's hash is the engine's chain hash,
    its tokens a page of them, `block_size` the engine's page size; the tier is left unset
    (the device)."""
    proto = common_pb2.KvEventBatch(
        sequence_number=batch.sequence_number, timestamp=batch.timestamp
    )
    for event_id, event in zip(batch.event_ids, batch.events, strict=True):
        message = proto.events.add(event_id=event_id)
        match event:
            case BlockStored():
                stored = message.stored
                if event.parent_hash is not None:
                    stored.parent_block_hash = event.parent_hash
                for key, tokens in zip(event.block_hashes, event.token_ids, strict=True):
                    block = stored.blocks.add(block_hash=key, token_ids=tokens)
                    block.block_size = page_size
                    if event.adapter:
                        block.lora_id = event.adapter
            case BlockRemoved():
                message.removed.block_hashes.extend(event.block_hashes)
            case AllBlocksCleared():
                message.cleared.SetInParent()
    return proto
