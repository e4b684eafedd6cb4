"""Overload: a burst is answered OK or RESOURCE_EXHAUSTED (with RetryInfo), never CANCELLED."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest
import structlog
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient

from engine.protocol.config import EngineConfig
from service.config import ServiceConfig
from tests.support.service_harness import health_status, make_fake_model, running_server, stub

HOLD = 300
SERVING = health_pb2.HealthCheckResponse.SERVING
# The burst. gRPC core used to cancel about a fifth of these before any handler ran.
BURST = 3000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), hold_token=HOLD, step_delay=0.05)


def request(*ids: int, max_tokens: int = 4, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=list(ids)),
        stop=pb.StopParams(max_tokens=max_tokens),
    )


async def outcome(generation, req: pb.GenerateRequest) -> str:
    """How one Generate call ended: "OK", "RESOURCE_EXHAUSTED+RetryInfo", or another code."""
    try:
        async for _ in generation.Generate(req, timeout=50):
            pass
    except grpc.aio.AioRpcError as err:
        return err.code().name + ("+RetryInfo" if has_retry_info(err) else "")
    return "OK"


def has_retry_info(err: grpc.aio.AioRpcError) -> bool:
    status = rpc_status.from_call(err)
    retry = error_details_pb2.RetryInfo()
    return status is not None and any(d.Unpack(retry) for d in status.details)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(90)
async def test_a_burst_of_generate_calls_ends_each_ok_or_resource_exhausted(model_dir):
    async with (
        running_server(model_dir, max_concurrent_rpcs=200) as (server, target),
        grpc.aio.insecure_channel(target) as channel,
    ):
        generation = stub(channel)
        outcomes = await asyncio.gather(
            *(outcome(generation, request(0, 5 + i % 50, max_tokens=16)) for i in range(BURST))
        )
        counts = collections.Counter(outcomes)
        assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED+RetryInfo"}, counts
        assert counts["OK"] > 0
        assert server.call_limit.in_use == 0
        assert await outcome(generation, request(0, 5)) == "OK"
        assert await health_status(channel) == SERVING


async def test_a_call_over_the_limit_is_refused_but_cancel_and_health_pass(model_dir):
    async with (
        running_server(model_dir, max_concurrent_rpcs=2, retry_after=0.5) as (server, target),
        grpc.aio.insecure_channel(target) as channel,
        AsyncClient(target) as client,
    ):
        generation = stub(channel)
        held = [
            asyncio.ensure_future(outcome(generation, request(0, HOLD, request_id=f"h{i}")))
            for i in range(2)
        ]
        await wait_until(lambda: server.call_limit.in_use == 2)
        with structlog.testing.capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as err:
            await generation.Generate(request(0, 5)).read()
        refusals = [e for e in logs if e["event"] == "request.refused"]
        assert refusals and refusals[0]["code"] == "RESOURCE_EXHAUSTED"
        assert refusals[0]["method"] == "/sluice.v1.Generation/Generate"
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-rpcs" in (err.value.details() or "")
        status = rpc_status.from_call(err.value)
        retry = error_details_pb2.RetryInfo()
        assert status is not None and status.details[0].Unpack(retry)
        delay_ms = retry.retry_delay.ToMilliseconds()
        assert 500 <= delay_ms <= 750  # retry_after with its jitter, x 1 to 1.5
        assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == str(delay_ms)
        assert await health_status(channel) == SERVING
        cancelled = await client.cancel(["h0", "h1"])
        assert sorted(cancelled.cancelled) == ["h0", "h1"]
        assert await asyncio.gather(*held) == ["OK", "OK"]
        assert server.call_limit.in_use == 0
        assert server.call_limit.refused == 1


async def test_a_client_that_leaves_gives_its_slot_back(model_dir):
    async with (
        running_server(model_dir, max_concurrent_rpcs=2) as (server, target),
        grpc.aio.insecure_channel(target) as channel,
    ):
        generation = stub(channel)
        calls = [generation.Generate(request(0, HOLD, request_id=f"gone{i}")) for i in range(2)]
        readers = [asyncio.ensure_future(call.read()) for call in calls]
        await wait_until(lambda: server.call_limit.in_use == 2)
        for call in calls:
            call.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await wait_until(lambda: server.call_limit.in_use == 0)
        await wait_until(lambda: not server.engine.in_flight)
        assert await outcome(generation, request(0, 5)) == "OK"
        assert server.call_limit.refused == 0


def test_max_concurrent_rpcs_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_concurrent_rpcs"):
        ServiceConfig(engine=EngineConfig(model=str(tmp_path)), max_concurrent_rpcs=0)
