"""End to end: `sluice serve` as a real process on the tiny checkpoint, under real signals.

A stopped engine is detected within `--stall-timeout`; SIGTERM with a stopped engine keeps to
`--shutdown-grace`; a `kill -9` of the server takes its (stopped) engine with it; an engine crash
after a checkpoint update and an inline one restores exactly the weights served before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest
import structlog
import torch
from grpc_health.v1 import health_pb2
from sluice_client import AsyncClient, Client, build_request, pb

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.server_process import force_kill, server_process, wait_gone
from tests.support.service_harness import health_status, running_server

pytestmark = pytest.mark.slow

PROMPTS = [[0, 17, 42, 99, 123, 7], [0, 5, 6, 7, 8, 9, 10, 11], [0, 200, 3, 77]]
ADMIN_TOKEN = "e2e-faults"
INLINE = ("model.norm.weight", "model.layers.0.mlp.down_proj.weight")
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def flags(model: Path, *extra: str) -> tuple[str, ...]:
    return ("--model", str(model), "--device", "cpu", "--dtype", "float32", *extra)


def greedy(prompt: list[int], max_tokens: int = 8):  # type: ignore[no-untyped-def]
    return build_request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@contextlib.contextmanager
def stopped(pid: int):  # type: ignore[no-untyped-def]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        force_kill(pid)  # whatever the test saw, leave no stopped engine behind


async def first_tokens(client: AsyncClient, count: int) -> tuple[list[asyncio.Task], asyncio.Event]:  # type: ignore[type-arg]
    """`count` long greedy streams; the event is set once one of them has produced a token."""
    seen = asyncio.Event()

    async def run(i: int) -> str:
        reason = ""
        async for event in client.generate(greedy([0, 5 + i], max_tokens=500)):
            if event.HasField("tokens"):
                seen.set()
            if event.HasField("finished"):
                reason = pb.FinishReason.Name(event.finished.reason)
        return reason

    return [asyncio.ensure_future(run(i)) for i in range(count)], seen


@pytest.mark.timeout(120)
async def test_a_stopped_engine_is_replaced_within_the_stall_timeout_flag(tiny_llama, tmp_path):
    with server_process(
        tmp_path / "server.log", *flags(tiny_llama, "--stall-timeout", "5", "--max-num-seqs", "2")
    ) as server:
        await asyncio.to_thread(server.wait_health, "SERVING")
        async with AsyncClient(server.target) as client:
            streams, seen = await first_tokens(client, 8)
            await asyncio.wait_for(seen.wait(), 30)
            with stopped(server.engine_pid()):
                start = time.monotonic()
                reasons = await asyncio.wait_for(asyncio.gather(*streams), 15)
                ended = time.monotonic() - start
                assert await asyncio.to_thread(server.health) == "NOT_SERVING"
            assert "FINISH_REASON_ERROR" in reasons and ended < 7.0, (reasons, ended)
            await asyncio.to_thread(server.wait_health, "SERVING", 60)
            done = await client.complete(greedy(PROMPTS[0]))
            assert done.reason == "LENGTH" and len(done.token_ids) == 8


@pytest.mark.timeout(120)
async def test_sigterm_with_a_stopped_engine_exits_within_the_grace_and_kills_it(
    tiny_llama, tmp_path
):
    with server_process(
        tmp_path / "server.log", *flags(tiny_llama, "--shutdown-grace", "2")
    ) as server:
        await asyncio.to_thread(server.wait_health, "SERVING")
        async with AsyncClient(server.target) as client:
            streams, seen = await first_tokens(client, 4)
            await asyncio.wait_for(seen.wait(), 30)
            pid = server.engine_pid()
            with stopped(pid):
                start = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(server.proc.wait, 30)
                took = time.monotonic() - start
                assert wait_gone(pid, 2.0), "the stopped engine outlived the server"
            for stream in streams:
                stream.cancel()
        assert code == 0 and took < 2 + 6, took  # grace + engine exit timeout + final flush


@pytest.mark.timeout(120)
async def test_ctrl_c_drains_in_flight_requests_and_exits_0(tiny_llama, tmp_path):
    """Ctrl-C at a terminal sends SIGINT to the server and its engine (one process group)."""
    log = tmp_path / "server.log"
    with server_process(log, *flags(tiny_llama), new_session=True) as server:
        await asyncio.to_thread(server.wait_health, "SERVING")
        async with AsyncClient(server.target) as client:
            events = client.generate(greedy([0, 5, 6, 7], max_tokens=300))
            assert (await anext(events)).WhichOneof("event") == "started"
            os.killpg(server.proc.pid, signal.SIGINT)
            finished = [e async for e in events if e.HasField("finished")]
        assert await asyncio.to_thread(server.proc.wait, 60) == 0
    assert [e.finished.reason for e in finished] == [pb.FINISH_REASON_LENGTH]
    assert server.events("engine.crashed") == [] and server.events("engine.lost") == []


@pytest.mark.timeout(120)
def test_a_killed_server_takes_its_stopped_engine_with_it(tiny_llama, tmp_path):
    with server_process(tmp_path / "server.log", *flags(tiny_llama)) as server:
        server.wait_health("SERVING")
        pid = server.engine_pid()
        with stopped(pid):
            server.proc.kill()
            server.proc.wait(10)
            assert wait_gone(pid, 5.0), "the engine was orphaned"


# ---- an engine crash restores the weights served before it ----


def make_engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))


def greedy_ids(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [r.token_ids for r in engine.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


@pytest.mark.timeout(180)
async def test_an_engine_crash_after_a_checkpoint_and_an_inline_update_keeps_both(
    tiny_llama, checkpoint_b, tmp_path
):
    # The expected weights: B, then two of its tensors replaced inline.
    generator = torch.Generator().manual_seed(5)
    reference = make_engine(checkpoint_b)
    b_only = greedy_ids(reference)
    shapes = {n: t.shape for n, t in reference.model.checkpoint_tensors().items() if n in INLINE}
    new = {name: torch.randn(shape, generator=generator) * 0.2 for name, shape in shapes.items()}
    with reference.live_weights() as live, torch.no_grad():
        for name, tensor in new.items():
            live[name].copy_(tensor)
    expected = greedy_ids(reference)
    assert expected != b_only  # a rollback to B alone would show

    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    with structlog.testing.capture_logs() as logs:
        async with (
            running_server(
                tiny_llama,
                fake=False,
                admin_token=ADMIN_TOKEN,
                weights_dir=str(weights_dir),
                restart_backoff=0.1,
            ) as (server, target),
            AsyncClient(target) as client,
        ):
            admin = Client(target, admin_token=ADMIN_TOKEN)
            await asyncio.to_thread(admin.update_weights, str(checkpoint_b))
            tensors = {n: ("F32", list(t.shape), t.numpy().tobytes()) for n, t in new.items()}
            applied = await asyncio.to_thread(admin.update_weights_inline, tensors)
            assert applied.policy_version == 2
            served = [(await client.complete(greedy(p))).token_ids for p in PROMPTS]
            assert served == expected
            for restarts in (1, 2):
                engine = server.engine.engine
                assert engine is not None and engine.pid is not None
                os.kill(engine.pid, signal.SIGKILL)
                for _ in range(600):
                    if (
                        server.engine.restarts == restarts
                        and server.engine.state.value == "serving"
                    ):
                        break
                    await asyncio.sleep(0.05)
                info = await client.info()
                assert info.policy_version == 2
                after = [await client.complete(greedy(p)) for p in PROMPTS]
                assert [c.token_ids for c in after] == expected
                assert {v for c in after for v in c.policy_versions} == {2}
    assert not [e for e in logs if e["event"] == "engine.replay_failed"]
    assert list(weights_dir.iterdir()) == []  # a clean shutdown deletes the inline file


async def wait_until(condition, seconds: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    """Poll `condition()` every 50 ms for up to `seconds`; whether it came true."""
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.timeout(180)
async def test_a_restart_refuses_to_replay_a_checkpoint_directory_overwritten_since(
    tiny_llama, checkpoint_b, tmp_path
):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint_b, directory)
    weights = directory / "model.safetensors"
    expected = greedy_ids(make_engine(checkpoint_b))
    with structlog.testing.capture_logs() as logs:
        async with (
            running_server(
                tiny_llama,
                fake=False,
                admin_token=ADMIN_TOKEN,
                restart_backoff=0.1,
                restart_backoff_max=0.2,
            ) as (server, target),
            AsyncClient(target) as client,
        ):
            admin = Client(target, admin_token=ADMIN_TOKEN)
            assert (
                await asyncio.to_thread(admin.update_weights, str(directory))
            ).policy_version == 1
            applied, original = weights.stat(), weights.read_bytes()
            # Redeployed in place a second later: other weights, the same size.
            weights.write_bytes((tiny_llama / "model.safetensors").read_bytes())
            os.utime(weights, ns=(applied.st_atime_ns, applied.st_mtime_ns + 10**9))
            engine = server.engine.engine
            assert engine is not None and engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)

            def refused() -> bool:
                return any(e["event"] == "engine.replay_refused" for e in logs)

            def serving() -> bool:
                return server.engine.restarts == 1 and server.engine.state.value == "serving"

            assert await wait_until(lambda: refused() or serving())
            assert refused() and not serving()  # never served A's weights as version 1
            event = next(e for e in logs if e["event"] == "engine.replay_refused")
            assert event["checkpoint_dir"] == str(directory) and event["policy_version"] == 1
            registry = server.metrics.registry
            assert registry.get_sample_value("sluice_weight_replays_refused_total") >= 1
            info = await client.info()
            assert info.state == pb.SERVING_STATE_RESTARTING and info.policy_version == 1
            async with grpc.aio.insecure_channel(target) as channel:
                assert await health_status(channel) == NOT_SERVING
            # Restored as it was applied: the next retry replays it and serves again.
            weights.write_bytes(original)
            os.utime(weights, ns=(applied.st_atime_ns, applied.st_mtime_ns))
            assert await wait_until(serving)
            served = [(await client.complete(greedy(p))).token_ids for p in PROMPTS]
            assert served == expected and (await client.info()).policy_version == 1
