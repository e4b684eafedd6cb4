"""Hostile LoRA adapters against a real server (the fake engine answers adapter calls): a config
whose numbers the engine cannot serve is refused INVALID_ARGUMENT naming the field before the
engine sees it, from a directory or a stream; a config that is a FIFO or a link to /dev/zero is
refused at once, while Tokenize keeps being answered; a stream of more tensors than an adapter
can have is refused naming `tensor.name`; the adapters' file work never waits on the thread
pool that tokenizes."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import admin_pb2_grpc, generation_pb2_grpc
from sluice.v1 import generation_pb2 as gpb

from engine.protocol.validation.adapter_config import CONFIG_FILE
from service.engine_link import adapter_spool
from service.engine_link.adapter_spool import MAX_ADAPTER_TENSORS
from tests.support.adapter_calls import ADMIN_TOKEN, refusal
from tests.support.service_harness import make_fake_model, running_server

METADATA = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
CALL_TIMEOUT = 10.0  # a hang fails the test instead of wedging it


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[object, str, Path]]:
    weights_dir = tmp_path / "weights_dir"
    weights_dir.mkdir()
    async with running_server(
        make_fake_model(tmp_path / "fake"),
        engine={"max_loras": 2, "max_lora_rank": 16},
        admin_token=ADMIN_TOKEN,
        weights_dir=str(weights_dir),
    ) as (running, target):
        yield running, target, weights_dir


def adapter_dir(root: Path, name: str, config_text: str) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / CONFIG_FILE).write_text(config_text)
    (directory / "adapter_model.safetensors").write_bytes(b"")  # the fake engine reads none
    return directory


def load(target: str, name: str, path: Path) -> apb.LoadAdapterResponse:
    with grpc.insecure_channel(target) as channel:
        return admin_pb2_grpc.AdminStub(channel).LoadAdapter(
            apb.LoadAdapterRequest(name=name, path=str(path)),
            metadata=METADATA,
            timeout=CALL_TIMEOUT,
        )


def header(name: str, config_text: str) -> apb.LoadAdapterStreamRequest:
    return apb.LoadAdapterStreamRequest(
        header=apb.LoadAdapterStreamHeader(
            request=apb.LoadAdapterRequest(name=name), adapter_config=config_text
        )
    )


def tiny_tensors(count: int) -> Iterator[apb.LoadAdapterStreamRequest]:
    for i in range(count):
        chunk = apb.TensorChunk(name=f"t{i}", dtype="F32", shape=[1], data=b"\0" * 4)
        yield apb.LoadAdapterStreamRequest(tensor=chunk)


def stream(target: str, messages: Iterator[apb.LoadAdapterStreamRequest]) -> object:
    with grpc.insecure_channel(target) as channel:
        return admin_pb2_grpc.AdminStub(channel).LoadAdapterStream(
            messages, metadata=METADATA, timeout=CALL_TIMEOUT
        )


def loaded(server: object) -> set[str]:
    return set(server.engine.adapters.names)  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alpha", ["NaN", "Infinity", "1e308", "1" + "0" * 400])
async def test_a_lora_alpha_the_engine_cannot_serve_never_reaches_it(
    server, tmp_path: Path, alpha: str
) -> None:  # type: ignore[no-untyped-def]
    running, target, weights_dir = server
    text = f'{{"r": 8, "lora_alpha": {alpha}, "target_modules": ["q_proj"]}}'
    bad = adapter_dir(tmp_path, "bad", text)
    code, fields = await asyncio.to_thread(refusal, lambda: load(target, "bad", bad))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["path"])
    streamed = [header("bad", text), *tiny_tensors(1)]
    code, fields = await asyncio.to_thread(refusal, lambda: stream(target, iter(streamed)))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["header.adapter_config"])
    assert loaded(running) == set()  # the fake engine loads anything it is sent: none was
    assert list(weights_dir.iterdir()) == []
    good = adapter_dir(tmp_path, "good", '{"r": 8, "lora_alpha": 16}')
    await asyncio.to_thread(load, target, "good", good)
    assert loaded(running) == {"good"}


@pytest.mark.timeout(60)
async def test_a_config_that_is_a_fifo_or_dev_zero_is_refused_while_tokenize_answers(
    server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Reading either blocked a thread of the pool that tokenizes (a FIFO: for good; /dev/zero:
    growing the service by about 1 GB/s): eight such loads starved every Tokenize."""
    _, target, _ = server
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / CONFIG_FILE)
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / CONFIG_FILE).symlink_to("/dev/zero")
    async with grpc.aio.insecure_channel(target) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        loads = [
            admin.LoadAdapter(
                apb.LoadAdapterRequest(name=f"x{i}", path=str(path)),
                metadata=METADATA,
                timeout=CALL_TIMEOUT,
            )
            for i, path in enumerate([fifo, zero] * 4)
        ]
        results = await asyncio.gather(*loads, return_exceptions=True)
        tokens = await generation_pb2_grpc.GenerationStub(channel).Tokenize(
            gpb.TokenizeRequest(text="still answered"), timeout=CALL_TIMEOUT
        )
    assert tokens.token_ids
    for result, kind in zip(results, ["a FIFO", "a character device"] * 4, strict=True):
        assert isinstance(result, grpc.aio.AioRpcError), result
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{CONFIG_FILE}: not a regular file ({kind})" in (result.details() or "")


@pytest.mark.timeout(60)
async def test_a_stream_of_more_tensors_than_an_adapter_has_is_refused_naming_tensor_name(
    server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # The bound is what a real adapter needs: two tensors a projection, seven a layer, more
    # layers than any dense model has (Llama 3.1 405B: 126).
    assert MAX_ADAPTER_TENSORS >= 2 * 7 * 126
    monkeypatch.setattr(adapter_spool, "MAX_ADAPTER_TENSORS", 64)  # the same rule, faster
    running, target, weights_dir = server
    messages = [header("many", '{"r": 8}'), *tiny_tensors(65)]
    code, fields = await asyncio.to_thread(refusal, lambda: stream(target, iter(messages)))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["tensor.name"])
    assert loaded(running) == set()
    assert list(weights_dir.iterdir()) == []


@pytest.mark.timeout(60)
async def test_adapter_file_work_never_waits_on_the_pool_that_tokenizes(
    server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """With every thread of the default executor (Tokenize's, RenderChat's) held, a directory
    load and a streamed one still complete: their reads and writes run on their own pool."""
    running, target, _ = server
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1, thread_name_prefix="held")
    release = threading.Event()
    loop.set_default_executor(pool)
    held = loop.run_in_executor(None, release.wait)
    try:
        good = adapter_dir(tmp_path, "good", '{"r": 8, "lora_alpha": 16}')
        async with grpc.aio.insecure_channel(target) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            await admin.LoadAdapter(
                apb.LoadAdapterRequest(name="good", path=str(good)),
                metadata=METADATA,
                timeout=CALL_TIMEOUT,
            )
            messages = [header("streamed", '{"r": 1}'), *tiny_tensors(3)]
            await admin.LoadAdapterStream(iter(messages), metadata=METADATA, timeout=CALL_TIMEOUT)
        assert loaded(running) == {"good", "streamed"}
    finally:
        release.set()
        await held
        loop.set_default_executor(ThreadPoolExecutor())
        pool.shutdown()
