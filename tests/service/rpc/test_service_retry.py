"""Retries done by gRPC: the server's pushback trailer beside RetryInfo, the clients' policy."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, Client

from service.rpc.refusal import PUSHBACK_KEY, Refusal
from tests.support.service_harness import make_fake_model, running_server

HOLD = 300
BURST = 12
# Pushback under test: the default backoff (0.25 s x a random fraction) could not wait as long.
PUSHBACK_S = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), hold_token=HOLD, step_delay=0.05)


def refusal_delays(err: grpc.aio.AioRpcError) -> tuple[int | None, int | None]:
    """(RetryInfo's delay, the grpc-retry-pushback-ms trailer) of a refused call, in ms."""
    status = rpc_status.from_call(err)
    retry = error_details_pb2.RetryInfo()
    has_retry_info = status is not None and any(d.Unpack(retry) for d in status.details)
    info_ms = retry.retry_delay.ToMilliseconds() if has_retry_info else None
    trailers = dict(err.trailing_metadata() or ())
    pushback = trailers.get(PUSHBACK_KEY)
    return info_ms, None if pushback is None else int(pushback)


async def burst(target: str, **client_options) -> list[str]:
    """How each of BURST concurrent requests ended: a finish reason or a status code."""
    async with AsyncClient(target, **client_options) as client:

        async def one(i: int) -> str:
            try:
                completion = await client.complete([0, 5 + i], max_tokens=4, timeout=20)
            except grpc.aio.AioRpcError as err:
                return err.code().name
            return completion.reason

        return await asyncio.gather(*(one(i) for i in range(BURST)))


@pytest.mark.timeout(60)
async def test_a_burst_refused_in_part_without_retries_completes_with_the_default_policy(
    model_dir,
):
    # A waiting queue of 4 sheds most of a burst of 12 that arrives within one engine step
    # (50 ms); the jittered pushback (0.2 to 0.3 s) spreads each round of retries over two
    # steps or more, each of which empties the queue.
    async with running_server(model_dir, max_waiting=4, retry_after=0.2) as (_, target):
        without = await burst(target, retry=False)
        assert "RESOURCE_EXHAUSTED" in without and "LENGTH" in without, without
        assert set(without) == {"RESOURCE_EXHAUSTED", "LENGTH"}
        assert await burst(target) == ["LENGTH"] * BURST


async def test_resource_exhausted_and_unavailable_carry_a_pushback_equal_to_retry_info(model_dir):
    async with (
        running_server(model_dir, max_waiting=1, retry_after=0.2) as (server, target),
        AsyncClient(target, retry=False) as client,
    ):
        held = asyncio.ensure_future(client.complete([0, HOLD], request_id="h", max_tokens=1))
        while server.engine.waiting < 1:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await client.complete([0, 5], max_tokens=1)
        stopping = asyncio.ensure_future(server.stop(grace=5.0))  # drains while "h" runs
        while not server.servicer.draining:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as draining:
            await client.complete([0, 5], max_tokens=1)
        await client.cancel(["h"])
        assert (await held).reason == "CANCELLED"
        await stopping
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert draining.value.code() == grpc.StatusCode.UNAVAILABLE
    for err in (full.value, draining.value):
        info_ms, pushback_ms = refusal_delays(err)
        assert info_ms == pushback_ms
        assert pushback_ms is not None and 200 <= pushback_ms <= 300  # retry_after x [1, 1.5]


def test_refusals_are_jittered_and_only_retryable_codes_get_a_pushback():
    delays = {Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "", retry_after=1.0).retry_delay_ms}
    for _ in range(20):
        delays.add(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "", retry_after=1.0).retry_delay_ms)
    assert len(delays) > 1 and all(d is not None and 1000 <= d <= 1500 for d in delays)
    other = Refusal(grpc.StatusCode.FAILED_PRECONDITION, "", retry_after=1.0).to_status()
    assert PUSHBACK_KEY not in dict(other.trailing_metadata)
    plain = Refusal(grpc.StatusCode.UNAVAILABLE, "").to_status()
    assert PUSHBACK_KEY not in dict(plain.trailing_metadata)


class RefuseFirst:
    """Tokenize that refuses its first call RESOURCE_EXHAUSTED with a pushback, then answers;
    `times` holds when each attempt arrived, `pushback_ms` what the refusal said."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.pushback_ms = 0

    async def tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self.times.append(time.monotonic())
        if len(self.times) == 1:
            refusal = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after=PUSHBACK_S)
            assert refusal.retry_delay_ms is not None
            self.pushback_ms = refusal.retry_delay_ms
            await context.abort_with_status(refusal.to_status())
        return pb.TokenizeResponse(token_ids=[7])


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
async def test_the_clients_retry_no_earlier_than_the_server_pushback(flavour):
    service = RefuseFirst()
    handler = grpc.method_handlers_generic_handler(
        "sluice.v1.Generation",
        {
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                service.tokenize,
                request_deserializer=pb.TokenizeRequest.FromString,
                response_serializer=pb.TokenizeResponse.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        target = f"127.0.0.1:{port}"
        if flavour == "sync":
            with Client(target) as sync_client:
                ids = await asyncio.to_thread(sync_client.tokenize, "x")
        else:
            async with AsyncClient(target) as client:
                ids = await client.tokenize("x")
    finally:
        await server.stop(None)
    assert ids == [7]
    first, second = service.times
    assert second - first >= service.pushback_ms / 1000


@pytest.mark.timeout(30)
async def test_a_request_waiting_for_newer_weights_is_retried_until_an_update_serves_them(
    model_dir,
):
    # A replica behind a balancer may serve older weights than the request asks for: it refuses
    # UNAVAILABLE with a pushback, and the client's own policy tries again until they arrive.
    admin_token = "retry-admin"
    async with (
        running_server(model_dir, admin_token=admin_token, retry_after=0.2) as (server, target),
        AsyncClient(target) as client,
    ):
        served = server.servicer.engine.policy_version
        gated = client.complete([0, 5, 6], max_tokens=2, min_policy_version=served + 1)
        waiting = asyncio.ensure_future(gated)
        await asyncio.sleep(0.3)  # refused at least once (pushback 0.2 to 0.3 s)
        assert not waiting.done()
        with Client(target, admin_token=admin_token) as admin:
            applied = await asyncio.to_thread(admin.update_weights, "/next")
        completion = await waiting
    assert applied.policy_version == served + 1
    assert completion.reason == "LENGTH" and completion.policy_versions == [served + 1] * 2
