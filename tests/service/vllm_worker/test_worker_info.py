"""The worker protocol's other calls against the tiny checkpoint: auth, HealthCheck through
start, serving and sleep, GetModelInfo, GetServerInfo, GetLoads, GetTokenizer's bundle,
reflection, and the calls answered UNIMPLEMENTED."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import transformers
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import admin_pb2_grpc, generation_pb2_grpc
from sluice.v1 import generation_pb2 as pb
from tokenizers import Tokenizer

from engine.protocol.config import EngineConfig
from service.config import ServiceConfig
from service.server import create_server
from service.vllm_worker.pb import common_pb2
from service.vllm_worker.pb import vllm_engine_pb2 as vpb
from tests.support.fake_engine import fake_engine_main
from tests.support.service_harness import health_status, make_fake_model, running_server
from tests.support.worker_calls import engine_stub

pytestmark = pytest.mark.asyncio(loop_scope="module")

API, ADMIN = "api-t0ken", "adm1n-t0ken"
AUTH = (("authorization", f"Bearer {API}"),)
SERVICE = "vllm.grpc.engine.VllmEngine"
PAGES = 96
VERSION = 5  # the served policy version (--policy-version)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path):
    async with running_server(
        tiny_llama,
        fake=False,
        engine={"num_kv_pages": PAGES, "policy_version": VERSION},
        api_token=API,
        admin_token=ADMIN,
        served_model_name="tiny",
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(server[1]) as channel:
        yield channel


async def health(channel) -> vpb.HealthCheckResponse:
    return await engine_stub(channel).HealthCheck(vpb.HealthCheckRequest(), metadata=AUTH)


async def test_every_call_but_health_check_needs_the_api_token(channel) -> None:
    stub = engine_stub(channel)
    for call in (
        stub.GetModelInfo(vpb.GetModelInfoRequest()),
        stub.GetLoads(vpb.GetLoadsRequest()),
        stub.Abort(vpb.AbortRequest(request_ids=["x"])),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        request = vpb.GenerateRequest(text="hi", sampling_params=vpb.SamplingParams(max_tokens=2))
        async for _ in stub.Generate(request):
            pass
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # As grpc.health.v1: the gateway probes it without a key, and it tells no more than health.
    assert (await stub.HealthCheck(vpb.HealthCheckRequest())).healthy
    assert (await health(channel)).healthy


async def test_model_info_is_the_checkpoints(channel, server, tiny_llama) -> None:
    call = engine_stub(channel).GetModelInfo(vpb.GetModelInfoRequest(), metadata=AUTH)
    info = await call
    assert dict(await call.initial_metadata())["sluice-policy-version"] == str(VERSION)
    config = json.loads((tiny_llama / "config.json").read_text())
    engine = server[0].engine.info
    assert info.model_path == str(tiny_llama) == info.tokenizer_path
    assert (info.served_model_name, info.is_generation, info.supports_vision) == (
        "tiny",
        True,
        False,
    )
    assert (info.model_type, list(info.architectures)) == ("llama", config["architectures"])
    assert info.vocab_size == config["vocab_size"]
    assert info.max_context_length == engine.max_model_len
    assert info.max_req_input_len == engine.max_model_len - 1
    assert list(info.eos_token_ids) == [config["eos_token_id"]]
    assert info.bos_token_id == config["bos_token_id"]


async def test_server_info_and_loads_follow_a_request_in_flight(channel, server) -> None:
    stub = engine_stub(channel)
    idle = await stub.GetLoads(vpb.GetLoadsRequest(), metadata=AUTH)
    (load,) = idle.loads
    assert (idle.dp_rank_count, load.num_running_reqs, load.num_waiting_reqs) == (1, 0, 0)
    assert load.max_total_num_tokens == PAGES * 16 and load.num_used_tokens == 0
    assert load.token_usage == 0.0 and load.max_running_requests == 128
    request = vpb.GenerateRequest(
        request_id="held",
        tokenized=vpb.TokenizedInput(input_ids=list(range(3, 40))),
        stream=True,
        sampling_params=vpb.SamplingParams(max_tokens=400, ignore_eos=True),
    )
    call = stub.Generate(request, metadata=AUTH)
    assert (await call.read()).WhichOneof("response") == "chunk"
    busy = (await stub.GetLoads(vpb.GetLoadsRequest(), metadata=AUTH)).loads[0]
    info_call = stub.GetServerInfo(vpb.GetServerInfoRequest(), metadata=AUTH)
    info = await info_call
    assert dict(await info_call.initial_metadata())["sluice-policy-version"] == str(VERSION)
    await stub.Abort(vpb.AbortRequest(request_ids=["held"]), metadata=AUTH)
    assert busy.num_running_reqs == 1 and busy.num_used_tokens >= 48  # 37 prompt tokens: 3 pages
    assert busy.token_usage == busy.num_used_tokens / busy.max_total_num_tokens
    assert (info.active_requests, info.is_paused, info.server_type) == (1, False, "sluice")
    assert (info.block_size, info.max_num_seqs, info.data_parallel_size) == (16, 128, 1)
    assert info.model_dtype == "torch.float32" and info.uptime_seconds > 0
    assert info.last_receive_timestamp > 0


async def test_the_tokenizer_bundle_is_the_checkpoints_files(channel, server, tiny_llama) -> None:
    chunks = [
        c
        async for c in engine_stub(channel).GetTokenizer(
            common_pb2.GetTokenizerRequest(), metadata=AUTH
        )
    ]
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        names = set(bundle.namelist())
        assert names == {"tokenizer.json", "tokenizer_config.json", "config.json"} | (
            {"generation_config.json"}
            if (tiny_llama / "generation_config.json").exists()
            else set()
        )
        for name in names:
            assert bundle.read(name) == (tiny_llama / name).read_bytes()
        unpacked = Path(server[0].config.engine.model).parent / "unpacked"
        bundle.extractall(unpacked)
    text = "Hello world, the quick brown fox."
    tokenizers_ids = Tokenizer.from_file(str(unpacked / "tokenizer.json")).encode(text).ids
    hf_ids = transformers.AutoTokenizer.from_pretrained(unpacked)(text)["input_ids"]
    served = await generation_pb2_grpc.GenerationStub(channel).Tokenize(
        pb.TokenizeRequest(text=text, add_special_tokens=True), metadata=AUTH
    )
    assert tokenizers_ids == hf_ids == list(served.token_ids)


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        ("Embed", vpb.EmbedRequest()),
        ("StartProfile", common_pb2.StartProfileRequest()),
        ("StopProfile", common_pb2.StopProfileRequest()),
    ],
)
async def test_embed_and_the_profiler_are_unimplemented_saying_why(
    channel, method, request_
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await getattr(engine_stub(channel), method)(request_, metadata=AUTH)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "not served" in (refused.value.details() or "")


async def test_reflection_lists_the_worker_protocol(channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for response in stub.ServerReflectionInfo(iter([request])):
        names = {s.name for s in response.list_services_response.service}
        assert SERVICE in names
        break


async def test_health_is_false_asleep_and_true_again_awake(channel) -> None:
    admin = admin_pb2_grpc.AdminStub(channel)
    token = (("authorization", f"Bearer {ADMIN}"),)
    assert await health(channel) == vpb.HealthCheckResponse(healthy=True, message="serving")
    await admin.Sleep(apb.SleepRequest(level=1), metadata=token, timeout=60)
    asleep = await health(channel)
    assert not asleep.healthy and "sleeping" in asleep.message
    info = await engine_stub(channel).GetServerInfo(vpb.GetServerInfoRequest(), metadata=AUTH)
    assert info.is_paused
    assert await health_status(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    await admin.Wake(apb.WakeRequest(), metadata=token, timeout=60)
    assert (await health(channel)).healthy
    assert await health_status(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING


async def test_health_is_false_while_the_engine_starts(tmp_path) -> None:
    release = tmp_path / "release"
    model = make_fake_model(tmp_path / "fake", start_when=str(release))
    config = ServiceConfig(
        engine=EngineConfig(model=str(model), device="cpu", dtype="float32", num_kv_pages=64),
        host="127.0.0.1",
        port=0,
    )
    server, port = create_server(config, fake_engine_main)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            starting = await engine_stub(channel).HealthCheck(vpb.HealthCheckRequest())
            assert not starting.healthy and "starting" in starting.message
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await engine_stub(channel).GetModelInfo(vpb.GetModelInfoRequest())
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            release.touch()
            await server.wait_ready(timeout=60)
            assert (await engine_stub(channel).HealthCheck(vpb.HealthCheckRequest())).healthy
    finally:
        await server.stop(grace=0)
