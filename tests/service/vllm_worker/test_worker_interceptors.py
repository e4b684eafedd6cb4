"""The server's interceptors on the worker protocol's methods, against the fake engine: the call
limit counts Generate but lets the gateway's Abort, HealthCheck and GetLoads through, and a
request message that does not parse is INVALID_ARGUMENT, not UNKNOWN."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from service.vllm_worker.pb import vllm_engine_pb2 as vpb
from tests.support.service_harness import make_fake_model, running_server
from tests.support.worker_calls import engine_stub

pytestmark = pytest.mark.asyncio

HOLD = 300  # the fake engine never advances a request whose prompt holds this id


async def test_the_call_limit_counts_generate_and_lets_the_gateways_probes_through(
    tmp_path,
) -> None:
    model = make_fake_model(tmp_path / "fake", hold_token=HOLD)
    async with (
        running_server(model, max_concurrent_rpcs=1, retry_after=0.5) as (server, target),
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = engine_stub(channel)
        held = vpb.GenerateRequest(
            request_id="held",
            tokenized=vpb.TokenizedInput(input_ids=[5, HOLD]),
            sampling_params=vpb.SamplingParams(max_tokens=4),
        )
        call = stub.Generate(held)
        deadline = time.monotonic() + 30
        while not server.engine.has("held") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # polls the condition, bounded
        assert server.engine.has("held")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            other = vpb.GenerateRequest(text="hi", sampling_params=vpb.SamplingParams(max_tokens=2))
            async for _ in stub.Generate(other):
                pass
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.HealthCheck(vpb.HealthCheckRequest())).healthy
        assert (await stub.GetLoads(vpb.GetLoadsRequest())).loads[0].num_running_reqs >= 0
        await stub.Abort(vpb.AbortRequest(request_ids=["held"]))
        (done,) = [r.complete async for r in call]
        assert done.finish_reason == "abort"


async def test_a_message_that_does_not_parse_is_invalid_argument(tmp_path) -> None:
    model = make_fake_model(tmp_path / "fake")
    async with (
        running_server(model) as (_, target),
        grpc.aio.insecure_channel(target) as channel,
    ):
        generate = channel.unary_stream(
            "/vllm.grpc.engine.VllmEngine/Generate",
            request_serializer=lambda raw: raw,
            response_deserializer=vpb.GenerateResponse.FromString,
        )
        not_utf8_text = b"\x1a\x02\xff\xfe"  # field 3 (text), 2 bytes that are not UTF-8
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in generate(not_utf8_text):
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
