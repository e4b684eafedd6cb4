"""Engine faults with the fake engine and real signals: a stopped engine, an engine lost while
its replacement replays the weight updates, versions at the end of uint64, shutdown with a hung
engine. Every test is bounded in time: a fault that wedges the event loop fails at the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2
from sluice_client import AsyncClient, Client

from engine.protocol.config import EngineConfig
from engine.protocol.messages import MAX_POLICY_VERSION
from service.config import ServiceConfig
from service.engine_link.engine_state import EngineState
from service.server import SluiceServer, create_server
from tests.support.fake_engine import fake_engine_main
from tests.support.service_harness import health_status, make_fake_model, running_server

SERVING = health_pb2.HealthCheckResponse.SERVING
ADMIN_TOKEN = "faults-admin"
LONG_PROMPT = 4000  # token ids per prompt: a few hundred such requests overfill a pipe


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_fake_model(tmp_path / "fake", step_delay=0.01, max_model_len=8192)


def engine_pid(server: SluiceServer) -> int:
    engine = server.engine.engine
    assert engine is not None and engine.pid is not None
    return engine.pid


@contextlib.contextmanager
def stopped(pid: int):  # type: ignore[no-untyped-def]
    """SIGSTOP the process; SIGCONT it on the way out in case it survived (it should not)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def serving(channel: grpc.aio.Channel) -> bool:
    return await health_status(channel) == SERVING


async def wait_until(predicate, timeout: float, interval: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `predicate()` (awaited if it returns an awaitable) is true; fails after
    `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        await asyncio.sleep(interval)
    raise AssertionError(f"not true within {timeout}s")


@pytest.mark.timeout(60)
async def test_a_stopped_engine_does_not_wedge_the_server_and_every_request_is_answered(
    model_dir, monkeypatch
):
    """Writes to a stopped engine fill its pipe. The event loop must keep answering health
    checks, requests past the pipe backlog are refused UNAVAILABLE at once, the rest end with
    ERROR when the stall is detected, and a new engine serves."""
    async with (
        running_server(model_dir, stall_timeout=3.0, max_pipe_backlog_bytes=256 * 1024) as (
            server,
            target,
        ),
        AsyncClient(target, retry=False) as client,
        grpc.aio.insecure_channel(target) as channel,
    ):
        prompts = [[0] + [5 + i % 300] * (LONG_PROMPT - 1) for i in range(300)]
        with stopped(engine_pid(server)):
            calls = [
                asyncio.ensure_future(client.complete(p, max_tokens=2, ignore_eos=True))
                for p in prompts
            ]
            await asyncio.sleep(0.5)
            # The loop answers while the engine is stopped (a blocking write would hang here).
            started = time.monotonic()
            await asyncio.wait_for(health_status(channel), 2.0)
            assert time.monotonic() - started < 1.0
            done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 15)
        refused = [r for r in done if isinstance(r, grpc.aio.AioRpcError)]
        ended = [r for r in done if not isinstance(r, BaseException)]
        assert refused and all(r.code() == grpc.StatusCode.UNAVAILABLE for r in refused)
        assert ended and all(c.reason == "ERROR" for c in ended)
        assert len(refused) + len(ended) == len(prompts)
        await wait_until(lambda: serving(channel), 15)
        assert (await client.complete([0, 5], max_tokens=2)).token_ids == [5, 5]
        assert server.engine.restarts == 1 and server.engine.router.waiting == 0


@pytest.mark.timeout(60)
async def test_a_stalled_engine_with_streams_in_flight_is_replaced_within_the_stall_timeout(
    model_dir,
):
    async with (
        running_server(model_dir, stall_timeout=2.0) as (server, target),
        AsyncClient(target) as client,
        grpc.aio.insecure_channel(target) as channel,
    ):
        streams = [
            asyncio.ensure_future(client.complete([0, 5 + i], max_tokens=10_000, ignore_eos=True))
            for i in range(20)
        ]
        await asyncio.sleep(0.3)
        with stopped(engine_pid(server)):
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams), 10)
            ended_after = time.monotonic() - start
            assert await health_status(channel) != SERVING
        assert all(r.reason == "ERROR" and "no progress" in r.finished.message for r in results)
        assert 2.0 <= ended_after < 4.0
        await wait_until(lambda: serving(channel), 15)
        assert (await client.complete([0, 7], max_tokens=1)).reason == "LENGTH"


@pytest.mark.timeout(60)
async def test_an_engine_killed_before_its_replacement_replays_the_updates_is_restarted_again(
    model_dir, monkeypatch
):
    """The first replacement is SIGKILLed after Ready, and its loss is seen, before the applied
    update is replayed into it: the supervisor must carry on and serve the updated version."""
    async with (
        running_server(model_dir, admin_token=ADMIN_TOKEN, restart_backoff=0.1) as (
            server,
            target,
        ),
        AsyncClient(target) as client,
    ):
        with Client(target, admin_token=ADMIN_TOKEN) as admin:
            applied = await asyncio.to_thread(admin.update_weights, "/checkpoints/b")
        assert applied.policy_version == 1
        replay = server.engine.replay
        killed: list[int] = []

        async def kill_then_replay() -> None:
            if not killed:
                engine = server.engine.engine
                assert engine is not None and engine.pid is not None
                killed.append(engine.pid)
                os.kill(engine.pid, signal.SIGKILL)
                await wait_until(engine.lost.is_set, 10)
            await replay()

        monkeypatch.setattr(server.engine, "replay", kill_then_replay)
        os.kill(engine_pid(server), signal.SIGKILL)
        await wait_until(lambda: killed and server.engine.state.value == "serving", 20)
        assert server.engine.restarts == 1
        info = await client.info()
        assert info.policy_version == 1 and server.engine.stats.policy_version == 1
        assert (await client.complete([0, 5], max_tokens=1)).token_ids == [5]


async def test_no_update_may_go_past_the_largest_policy_version(model_dir):
    async with (
        running_server(model_dir, admin_token=ADMIN_TOKEN) as (_, target),
        AsyncClient(target) as client,
    ):
        admin = Client(target, admin_token=ADMIN_TOKEN)
        top = await asyncio.to_thread(
            admin.update_weights, "/checkpoints/b", policy_version=MAX_POLICY_VERSION
        )
        assert top.policy_version == MAX_POLICY_VERSION
        with pytest.raises(grpc.RpcError) as err:
            await asyncio.to_thread(admin.update_weights, "/checkpoints/c")
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        info = await client.info()
        assert info.policy_version == MAX_POLICY_VERSION
        done = await client.complete([0, 5], max_tokens=1)
        assert done.reason == "LENGTH" and done.policy_versions == [MAX_POLICY_VERSION]


@pytest.mark.timeout(60)
async def test_shutdown_with_a_stopped_engine_keeps_to_the_grace_and_kills_the_engine(
    model_dir,
):
    config = ServiceConfig(
        engine=EngineConfig(model=str(model_dir)), port=0, engine_exit_timeout=1.0
    )
    server, port = create_server(config, fake_engine_main)
    await server.start()
    await server.wait_ready(timeout=60)
    async with AsyncClient(f"127.0.0.1:{port}") as client:
        stream = asyncio.ensure_future(client.complete([0, 5], max_tokens=10_000))
        await asyncio.sleep(0.2)
        pid = engine_pid(server)
        with stopped(pid):
            start = time.monotonic()
            await server.stop(grace=1.0)
            took = time.monotonic() - start
        # grace 1 s + engine exit 1 s + the final flush (2 s) at most, plus scheduling slack
        assert took < 5.5, took
        assert (await stream).reason == "ERROR"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_inline_update_files_are_replayed_once_and_deleted_at_shutdown(model_dir, tmp_path):
    """A checkpoint update then an inline one, then two engine crashes: both replays apply
    both updates (the inline file survives the replayed checkpoint update), the log does not
    grow, nothing logs a failed replay, and a clean shutdown deletes the tensor file."""
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    with structlog.testing.capture_logs() as logs:
        async with running_server(
            model_dir, admin_token=ADMIN_TOKEN, weights_dir=str(weights_dir), restart_backoff=0.1
        ) as (server, target):
            admin = Client(target, admin_token=ADMIN_TOKEN)
            await asyncio.to_thread(admin.update_weights, "/checkpoints/b")
            tensors = {"w": ("F32", [2, 2], bytes(range(16)))}
            applied = await asyncio.to_thread(admin.update_weights_inline, tensors)
            assert applied.policy_version == 2 and len(list(weights_dir.iterdir())) == 1
            for restarts in (1, 2):
                (model_dir / "last_update.json").unlink()
                os.kill(engine_pid(server), signal.SIGKILL)
                await wait_until(lambda n=restarts: server.engine.restarts == n, 20)
                await wait_until(lambda: server.engine.state.value == "serving", 20)
                assert server.engine.policy_version == 2 == server.engine.stats.policy_version
                assert (model_dir / "last_update.json").exists()  # the inline update replayed
                assert len(server.engine.replay_log.entries()) == 2
    assert not [e for e in logs if e["event"] == "engine.replay_failed"]
    assert list(weights_dir.iterdir()) == []


@pytest.mark.timeout(60)
async def test_a_lost_engine_is_restarting_at_once_not_serving_until_the_supervisor_wakes(
    model_dir,
):
    """Between the loss and the Supervisor's next turn a request would otherwise be admitted
    as if the lost engine served it (and refused UNAVAILABLE, the client told to retry)."""
    async with (
        running_server(model_dir) as (server, target),
        AsyncClient(target, retry=False) as client,
    ):
        lost = server.engine.engine
        assert lost is not None and server.engine.state is EngineState.SERVING
        server.engine.lose(lost, "lost by the test")
        assert server.engine.state is EngineState.RESTARTING  # before any other task ran
        await wait_until(lambda: server.engine.state is EngineState.SERVING, 30)
        assert server.engine.engine is not lost
        assert (await client.complete([0, 5], max_tokens=2)).token_ids == [5, 5]
