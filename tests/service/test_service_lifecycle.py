"""Server lifecycle with a fake engine: engine death and restart, queue bound, auth, drain."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status
from sluice_client import AsyncClient, Collector, build_request

from tests.support.service_harness import health_status, make_fake_model, running_server

HOLD, DIE = 300, 301
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(
        tmp_path_factory.mktemp("fake"), hold_token=HOLD, die_on_token=DIE, step_delay=0.01
    )


def test_importing_the_server_does_not_import_torch():
    code = "import sys, service.server, service.cli; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


async def test_engine_death_ends_in_flight_requests_with_error_and_restarts(model_dir):
    async with (
        running_server(model_dir, restart_backoff=0.1) as (server, target),
        AsyncClient(target) as client,
        grpc.aio.insecure_channel(target) as channel,
    ):
        assert await health_status(channel, "sluice.v1.Generation") == SERVING
        in_flight = asyncio.ensure_future(client.complete([0, HOLD], max_tokens=5))
        await asyncio.sleep(0.2)
        killer = await client.complete([0, DIE], max_tokens=1)
        assert killer.reason == "ERROR"
        victim = await in_flight
        assert victim.reason == "ERROR" and "engine" in victim.finished.message
        assert await health_status(channel) != SERVING
        for _ in range(200):
            if await health_status(channel) == SERVING:
                break
            await asyncio.sleep(0.05)
        assert await health_status(channel) == SERVING
        assert (await client.complete([0, 5], max_tokens=2)).reason == "LENGTH"
        assert server.engine.restarts == 1


async def test_full_waiting_queue_is_resource_exhausted_with_retry_info(model_dir):
    async with (
        running_server(model_dir, max_waiting=1) as (_, target),
        AsyncClient(target, retry=False) as client,
    ):
        held = asyncio.ensure_future(client.complete([0, HOLD], request_id="h", max_tokens=1))
        await asyncio.sleep(0.2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete([0, 5], max_tokens=1)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(err.value)
        retry = error_details_pb2.RetryInfo()
        assert status is not None and status.details[0].Unpack(retry)
        await client.cancel(["h"])
        assert (await held).reason == "CANCELLED"


async def test_api_token_is_required_for_generation_but_not_health(model_dir):
    async with running_server(model_dir, api_token="s3cret") as (_, target):
        async with grpc.aio.insecure_channel(target) as channel:
            assert await health_status(channel) == SERVING
        for token, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ("wrong", grpc.StatusCode.PERMISSION_DENIED),
        ):
            async with AsyncClient(target, api_token=token) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.info()
                assert err.value.code() == code
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.complete("a", max_tokens=1)
                assert err.value.code() == code
        async with AsyncClient(target, api_token="s3cret") as client:
            assert (await client.complete([0, 5], max_tokens=1)).reason == "LENGTH"


async def test_drain_lets_in_flight_finish_refuses_new_and_aborts_the_rest(model_dir):
    async with (
        running_server(model_dir) as (server, target),
        AsyncClient(target, retry=False) as client,
    ):
        short = asyncio.ensure_future(client.complete([0, 5, 6], max_tokens=10))
        stuck = asyncio.ensure_future(client.complete([0, HOLD], max_tokens=10))
        await asyncio.sleep(0.1)
        stopping = asyncio.ensure_future(server.stop(grace=1.0))
        await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete([0, 5], max_tokens=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (await short).reason == "LENGTH"
        aborted = await stuck
        assert aborted.reason == "ABORTED" and aborted.finished.message
        await stopping


async def test_generate_many_over_one_stream(model_dir):
    async with running_server(model_dir) as (_, target), AsyncClient(target) as client:
        collector = Collector()
        prompts = [build_request([0, 5 + i], request_id=f"m{i}", max_tokens=2) for i in range(8)]
        async for event in client.generate_many(prompts):
            collector.add(event)
        assert {c.request_id: c.token_ids for c in collector.completions.values()} == {
            f"m{i}": [5 + i, 5 + i] for i in range(8)
        }
        assert all(c.reason == "LENGTH" for c in collector.completions.values())
