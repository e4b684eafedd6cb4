"""An idle engine's silence, judged with real processes and real signals: a runnable engine
(starved of CPU, here acted out by a main thread that computes without a word) is not hung
before the stall timeout, while a stopped or deadlocked one is replaced at the heartbeat
timeout. Every test is bounded in time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from sluice_client import AsyncClient

from service.engine_link.engine_process import EngineProcess
from service.engine_link.liveness import process_state
from service.server import SluiceServer
from tests.support.service_harness import health_status, make_fake_model, running_server

SERVING = health_pb2.HealthCheckResponse.SERVING
HEARTBEAT_TIMEOUT = 1.5
BUSY_SILENCE = 4.0  # well past the heartbeat timeout, well inside the stall timeout


def model_dir(tmp_path: Path, busy_silence: float) -> Path:
    return make_fake_model(tmp_path / "fake", busy_silence=busy_silence)


def current_engine(server: SluiceServer) -> EngineProcess:
    engine = server.engine.engine
    assert engine is not None and engine.pid is not None
    return engine


async def wait_until(predicate, timeout: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `predicate()` is true; fails after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not true within {timeout}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.timeout(60)
async def test_an_idle_engine_that_is_runnable_but_silent_is_not_declared_hung(tmp_path):
    """Before, the idle clock alone decided: silent for the heartbeat timeout meant hung, so an
    engine waiting for a CPU on a loaded machine was killed and the server went NOT_SERVING."""
    async with (
        running_server(
            model_dir(tmp_path, BUSY_SILENCE), heartbeat_timeout=HEARTBEAT_TIMEOUT, stall_timeout=30
        ) as (server, target),
        AsyncClient(target) as client,
        grpc.aio.insecure_channel(target) as channel,
    ):
        engine = current_engine(server)
        assert engine.pid is not None
        signalled = time.monotonic()
        os.kill(engine.pid, signal.SIGUSR1)
        # The first message after the silence: the engine spoke again on its own.
        await wait_until(lambda: engine.last_message - signalled >= BUSY_SILENCE, 20)
        assert server.engine.engine is engine and not engine.lost.is_set()
        assert server.engine.restarts == 0
        assert await health_status(channel) == SERVING
        assert (await client.complete([0, 5], max_tokens=2)).token_ids == [5, 5]


@pytest.mark.timeout(60)
async def test_an_idle_engine_that_runs_but_never_answers_is_hung_at_the_stall_timeout(tmp_path):
    async with running_server(
        model_dir(tmp_path, 60.0), heartbeat_timeout=HEARTBEAT_TIMEOUT, stall_timeout=3.0
    ) as (server, _):
        engine = current_engine(server)
        assert engine.pid is not None
        signalled = time.monotonic()
        os.kill(engine.pid, signal.SIGUSR1)
        await wait_until(engine.lost.is_set, 10)
        assert 3.0 <= time.monotonic() - signalled < 6.0
        await wait_until(lambda: server.engine.restarts == 1, 20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fault", "state"), [(signal.SIGSTOP, "T"), (signal.SIGUSR2, None)], ids=["stopped", "deadlock"]
)
async def test_an_idle_stopped_or_deadlocked_engine_is_replaced_at_the_heartbeat_timeout(
    tmp_path, fault, state
):
    async with (
        running_server(
            model_dir(tmp_path, 0.0), heartbeat_timeout=HEARTBEAT_TIMEOUT, stall_timeout=30
        ) as (server, target),
        AsyncClient(target) as client,
        grpc.aio.insecure_channel(target) as channel,
    ):
        engine = current_engine(server)
        assert engine.pid is not None
        signalled = time.monotonic()
        os.kill(engine.pid, fault)
        try:
            if state is not None:
                await wait_until(lambda: process_state(engine.pid or 0) == state, 5)
            await wait_until(engine.lost.is_set, 10)
            assert time.monotonic() - signalled < HEARTBEAT_TIMEOUT + 2.0
        finally:
            if fault == signal.SIGSTOP and process_state(engine.pid) is not None:
                os.kill(engine.pid, signal.SIGCONT)
        await wait_until(lambda: server.engine.restarts == 1, 20)
        start = time.monotonic()
        while await health_status(channel) != SERVING:
            assert time.monotonic() - start < 20
            await asyncio.sleep(0.05)
        assert (await client.complete([0, 5], max_tokens=2)).token_ids == [5, 5]


def test_process_state_reads_the_main_threads_state_and_none_for_a_missing_process():
    assert process_state(os.getpid()) == "R"  # reading it, so running
    assert process_state(2**22 + 1) is None  # above the largest pid Linux hands out
