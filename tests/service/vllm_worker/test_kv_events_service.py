"""SubscribeKvEvents and FlushCache over a real channel, on a real (tiny) engine: the headers
first, the prompt's pages as the engine caches them, a resume by sequence number, a flush's
AllBlocksCleared, and the bounds (an expired cursor, a slow subscriber, a bad timeout)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from sluice_client import AsyncClient

from engine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from service.engine_link.engine_client import EngineClient
from service.engine_link.kv_event_log import KvEventBatch, KvEventLog
from service.vllm_worker.cache_calls import CacheCalls, batch_proto
from service.vllm_worker.pb import common_pb2, vllm_engine_pb2_grpc
from tests.support.service_harness import running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAGE = 16
PROMPT = list(range(5, 5 + 2 * PAGE + 3))  # two full pages and a partial one
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


class CacheServicer(CacheCalls, vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_llama: Path) -> AsyncIterator[tuple[EngineClient, str, str]]:
    """The engine, the sluice.v1 target and the worker-protocol target."""
    async with running_server(tiny_llama, fake=False, engine={"page_size": PAGE}) as (server, at):
        worker = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(CacheServicer(server.engine), worker)
        port = worker.add_insecure_port("127.0.0.1:0")
        await worker.start()
        try:
            yield server.engine, at, f"127.0.0.1:{port}"
        finally:
            await worker.stop(0)


@pytest_asyncio.fixture(loop_scope="module")
async def stub(served) -> AsyncIterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(served[2]) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def subscribe(stub, start: int = 0):
    return stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))


async def read_until(call, wanted: str) -> list[common_pb2.KvEventBatch]:
    """Batches up to the first that carries an event of kind `wanted`."""
    batches = []
    while True:
        batch = await asyncio.wait_for(call.read(), 30)
        batches.append(batch)
        if any(e.WhichOneof("data") == wanted for e in batch.events):
            return batches


async def generate(target: str, prompt: list[int]) -> None:
    async with AsyncClient(target) as client:
        await client.complete(prompt, **GREEDY)


async def test_headers_then_the_prompts_pages_chained_as_the_engine_hashes_them(served, stub):
    engine, target, _ = served
    call = subscribe(stub)
    await asyncio.wait_for(call.initial_metadata(), 2)  # the gateway's deadline
    # From zero with the whole history held: the engine's first event, its empty cache.
    first = await asyncio.wait_for(call.read(), 30)
    assert first.sequence_number == 1 and first.events[0].WhichOneof("data") == "cleared"
    await generate(target, PROMPT)
    batches = await read_until(call, "stored")
    blocks = [b for e in batches[-1].events if e.HasField("stored") for b in e.stored.blocks]
    stored = next(e.stored for e in batches[-1].events if e.HasField("stored"))
    assert [list(b.token_ids) for b in blocks] == [PROMPT[:PAGE], PROMPT[PAGE : 2 * PAGE]]
    assert [b.block_size for b in blocks] == [PAGE, PAGE]
    assert not stored.HasField("parent_block_hash")  # the prompt's first page
    # The hashes are the engine's chain: a repeat of the prompt hits exactly these pages.
    hits_before = engine.stats.prefix_cache_hits
    await generate(target, PROMPT)
    assert engine.stats.prefix_cache_hits - hits_before == 2 * PAGE
    ids = [e.event_id for b in [first, *batches] for e in b.events]
    assert ids == sorted(set(ids))  # strictly increasing
    call.cancel()


async def test_a_resume_by_sequence_number_gets_the_same_batches_again(served, stub):
    _, target, _ = served
    call = subscribe(stub)
    await call.initial_metadata()
    await generate(target, [7, *PROMPT])
    seen = await read_until(call, "stored")
    call.cancel()
    start = seen[0].sequence_number - 1
    resumed = subscribe(stub, start)
    again = [await asyncio.wait_for(resumed.read(), 30) for _ in seen]
    assert again == seen
    resumed.cancel()


async def test_flush_cache_answers_after_its_all_blocks_cleared(served, stub):
    engine, target, _ = served
    await generate(target, [9, *PROMPT])
    assert engine.stats.cached_pages > 0
    call = subscribe(stub, engine.kv_events.last_sequence)
    await call.initial_metadata()
    answer = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
    assert answer.success, answer.message
    batches = await read_until(call, "cleared")
    assert batches[-1].events[-1].WhichOneof("data") == "cleared"
    assert (await engine.refresh_stats()).cached_pages == 0
    call.cancel()


async def test_a_cursor_the_history_lost_is_out_of_range(stub):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await subscribe(stub, 10**9).read()
    assert error.value.code() is grpc.StatusCode.OUT_OF_RANGE
    assert "subscribe from 0" in (error.value.details() or "")


async def test_a_bad_timeout_is_invalid_argument(stub):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=float("nan")))
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_s" in (error.value.details() or "")


async def test_a_slow_subscriber_is_dropped_with_data_loss(served, stub):
    engine = served[0]
    kept, engine.kv_events = engine.kv_events, KvEventLog(max_batches=8)
    try:
        call = subscribe(stub)
        await call.initial_metadata()
        for key in range(100):  # without yielding: the subscriber reads none of them
            engine.kv_events.add([BlockRemoved([key])])
        with pytest.raises(grpc.aio.AioRpcError) as error:
            while True:
                await asyncio.wait_for(call.read(), 30)
        assert error.value.code() is grpc.StatusCode.DATA_LOSS
        assert "fell behind" in (error.value.details() or "")
    finally:
        engine.kv_events = kept


async def test_a_restarted_engine_begins_with_all_blocks_cleared_numbered_on(served, stub):
    engine, target, _ = served
    await generate(target, [11, *PROMPT])
    before = engine.kv_events.last_sequence
    call = subscribe(stub, before)
    await call.initial_metadata()
    lost = engine.engine
    assert lost is not None and lost.pid is not None
    os.kill(lost.pid, signal.SIGKILL)
    batches = await read_until(call, "cleared")  # the new engine's first batch
    assert engine.engine is not lost
    assert [b.sequence_number for b in batches] == list(
        range(before + 1, before + 1 + len(batches))
    )
    await generate(target, PROMPT)  # it serves, and publishes again
    assert await read_until(call, "stored")
    call.cancel()


async def test_a_batch_becomes_the_protocols_message_field_for_field():
    events = [
        BlockStored([11, 12], 10, [(1, 2), (3, 4)], adapter=3),
        BlockRemoved([10, 9]),
        AllBlocksCleared(),
    ]
    proto = batch_proto(KvEventBatch(7, 1.5, range(20, 23), events), page_size=2)
    assert (proto.sequence_number, proto.timestamp) == (7, 1.5)
    assert [e.event_id for e in proto.events] == [20, 21, 22]
    stored, removed, cleared = proto.events
    assert stored.stored.parent_block_hash == 10
    assert [
        (b.block_hash, list(b.token_ids), b.block_size, b.lora_id) for b in stored.stored.blocks
    ] == [
        (11, [1, 2], 2, 3),
        (12, [3, 4], 2, 3),
    ]
    assert list(removed.removed.block_hashes) == [10, 9]
    assert cleared.WhichOneof("data") == "cleared"
