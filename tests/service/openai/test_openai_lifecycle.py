"""The OpenAI port lives and dies with the server (fake engine): a closed stream cancels its
request in the engine, a drain lets a stream finish while /health and new requests get 503,
and a port in use fails the start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from engine.protocol.config import EngineConfig
from service.config import ServiceConfig
from service.engine_link.engine_state import EngineState
from service.server import BindError, create_server
from tests.support.fake_engine import fake_engine_main
from tests.support.service_harness import make_fake_model

HOLD = 300  # a prompt holding this id stays queued until aborted
DIE = 301  # a prompt holding this id kills the engine


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_fake_model(
        tmp_path / "fake", hold_token=HOLD, die_on_token=DIE, step_delay=0.02, max_model_len=256
    )


def config(model_dir: Path, **fields) -> ServiceConfig:
    engine = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_pages=64)
    return ServiceConfig(
        engine=engine, host="127.0.0.1", port=0, openai_port=0, restart_backoff=0.1, **fields
    )


@contextlib.asynccontextmanager
async def started(model_dir: Path, **fields):
    server, _ = create_server(config(model_dir, **fields), fake_engine_main)
    await server.start()
    try:
        await server.wait_ready(timeout=60)
        assert server.openai is not None
        yield server, f"http://127.0.0.1:{server.openai.port}"
    finally:
        await server.stop(grace=1.0)


async def wait_until(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition never held"
        await asyncio.sleep(0.01)


async def test_closing_a_stream_cancels_its_request_in_the_engine(model_dir):
    async with started(model_dir) as (server, base), aiohttp.ClientSession() as session:
        body = {"prompt": [0, 5, HOLD], "max_tokens": 8, "stream": True}
        response = await session.post(base + "/v1/completions", json=body)
        assert response.status == 200
        await wait_until(lambda: server.engine.in_flight == 1)
        response.close()  # the client goes away mid-stream
        await wait_until(lambda: server.engine.in_flight == 0)


async def test_drain_finishes_streams_in_flight_and_refuses_new_work(model_dir):
    server, _ = create_server(config(model_dir), fake_engine_main)
    await server.start()
    await server.wait_ready(timeout=60)
    assert server.openai is not None
    base = f"http://127.0.0.1:{server.openai.port}"
    async with aiohttp.ClientSession() as session:
        body = {"prompt": [0, 5, 6, 7], "max_tokens": 40, "stream": True}
        response = await session.post(base + "/v1/completions", json=body)
        first = await response.content.readline()  # the stream has started
        assert first.startswith(b"data: ")
        stopping = asyncio.create_task(server.stop(grace=10.0))
        await wait_until(lambda: server.servicer.draining)
        async with session.get(base + "/health") as health:
            assert health.status == 503
        async with session.post(base + "/v1/completions", json={"prompt": "x"}) as refused:
            assert refused.status == 503 and "Retry-After" in refused.headers
        lines = [first] + [line async for line in response.content]
        await stopping
    events = [line[len(b"data: ") :].strip() for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0


async def test_a_port_in_use_fails_the_start(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match="openai"):
            create_server(
                ServiceConfig(
                    engine=EngineConfig(model=str(model_dir)),
                    host="127.0.0.1",
                    port=0,
                    openai_port=port,
                ),
                fake_engine_main,
            )


async def test_a_refused_prompt_refuses_the_request_and_frees_the_prompts_admitted(model_dir):
    async with started(model_dir) as (server, base), aiohttp.ClientSession() as session:
        body = {"prompt": [[0, 5, HOLD], [0, 10**6]], "max_tokens": 4}
        async with session.post(base + "/v1/completions", json=body) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"].startswith("prompt")
        await wait_until(lambda: server.engine.in_flight == 0)


async def test_a_client_leaving_before_a_whole_answer_cancels_its_request(model_dir):
    async with started(model_dir) as (server, base), aiohttp.ClientSession() as session:
        body = {"prompt": [0, 5, HOLD], "max_tokens": 8}
        call = asyncio.create_task(session.post(base + "/v1/completions", json=body))
        await wait_until(lambda: server.engine.in_flight == 1)
        call.cancel()  # the client gives up: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await wait_until(lambda: server.engine.in_flight == 0)


async def test_a_request_the_engine_fails_is_an_error_event_streamed_or_a_500_whole(model_dir):
    async with started(model_dir) as (server, base), aiohttp.ClientSession() as session:
        body = {"prompt": [0, DIE], "max_tokens": 4, "stream": True}
        async with session.post(base + "/v1/completions", json=body) as streamed:
            assert streamed.status == 200
            lines = [line.strip() async for line in streamed.content if line.strip()]
        assert lines[-1] == b"data: [DONE]"
        error = json.loads(lines[-2][len(b"data: ") :])["error"]
        assert error["code"] == 500 and "engine" in error["message"]
        await wait_until(lambda: server.engine.state is EngineState.SERVING)
        body = {"prompt": [0, DIE], "max_tokens": 4}
        async with session.post(base + "/v1/completions", json=body) as whole:
            assert whole.status == 500
            assert "engine" in (await whole.json())["error"]["message"]


async def test_uvicorn_leaves_the_services_signal_handlers_alone(model_dir):
    """uvicorn would install SIGTERM and SIGINT handlers of its own and close its port at once
    on a signal, before the service drains (whose /health must answer 503 meanwhile)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    async with started(model_dir) as (_, base), aiohttp.ClientSession() as session:
        async with session.get(base + "/health") as health:  # uvicorn is serving by now
            assert health.status == 200
        assert {sig: signal.getsignal(sig) for sig in before} == before


async def test_a_full_queue_is_429_with_retry_after(model_dir):
    async with started(model_dir, max_waiting=1) as (server, base), aiohttp.ClientSession() as s:
        held = await s.post(base + "/v1/completions", json={"prompt": [0, HOLD], "stream": True})
        await wait_until(lambda: server.engine.waiting == 1)
        async with s.post(base + "/v1/completions", json={"prompt": [0, 5]}) as refused:
            assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1
            assert (await refused.json())["error"]["code"] == "resource_exhausted"
        held.close()
