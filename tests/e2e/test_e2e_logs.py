"""End to end: the logs of `sluice serve` and of its engine process, read from their stderr.

Every line of a run with refusals, cancellations, a killed engine and a shutdown is one JSON
object with the same fields, from both processes; request lines carry their request's id and no
other line does. An engine that raises logs its traceback as a field. `--log-format console`
writes lines for a person instead, from both processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from sluice_client import AsyncClient, build_request, pb

from tests.support.server_process import REPO, ServerProcess, server_process

pytestmark = pytest.mark.slow

FIELDS = {"event", "level", "timestamp", "logger", "process", "pid"}
LEVELS = {"debug", "info", "warning", "error", "critical"}
REQUEST_EVENTS = {"request.refused", "request.finished", "request.abandoned"}


def flags(model: Path, *extra: str) -> tuple[str, ...]:
    return ("--model", str(model), "--device", "cpu", "--dtype", "float32", *extra)


def parse_log(text: str) -> list[dict[str, Any]]:
    """Every line as a JSON event; fails naming the lines that are not one."""
    events, bad = [], []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            bad.append(line)
            continue
        if not (isinstance(event, dict) and event.keys() >= FIELDS and event["level"] in LEVELS):
            bad.append(line)
            continue
        events.append(event)
    assert not bad, "lines that are not one JSON event:\n" + "\n".join(bad)
    return events


def by_request(events: list[dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    return {e["request_id"]: e for e in events if e["event"] == name}


def long_request(request_id: str) -> pb.GenerateRequest:
    return build_request(
        [0, 5, 6, 7], request_id=request_id, temperature=0.0, max_tokens=400, ignore_eos=True
    )


def refused_request(request_id: str) -> pb.GenerateRequest:
    return build_request([0, 5, 6], request_id=request_id, temperature=-1.0)


async def first_token_then(
    client: AsyncClient, request_id: str, act: Callable[[], Awaitable[None]] | None
) -> str:
    """Runs a long request, calls `act()` once its first token arrives; its finish reason."""
    async for event in client.generate(long_request(request_id)):
        if event.HasField("tokens") and act is not None:
            await act()
            act = None
        if event.HasField("finished"):
            return pb.FinishReason.Name(event.finished.reason)
    raise AssertionError(f"{request_id} ended without a finished event")


async def workload(server: ServerProcess, client: AsyncClient) -> None:
    """A refused request (unary and streamed), one cancelled by Cancel and one by its caller,
    one streamed to its end, one in flight when the engine is killed, one after the restart."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.complete(refused_request("refused-unary"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    stream = client.stream()
    await stream.start(refused_request("refused-in-stream"))
    await stream.start(
        build_request([0, 9, 8], request_id="streamed", max_tokens=4, ignore_eos=True)
    )
    await stream.done_sending()
    assert [e.request_id async for e in stream if e.HasField("finished")] == ["streamed"]

    async def cancel() -> None:
        assert list((await client.cancel(["cancelled-by-rpc"])).cancelled) == ["cancelled-by-rpc"]

    assert await first_token_then(client, "cancelled-by-rpc", cancel) == "FINISH_REASON_CANCELLED"

    events = client.generate(long_request("abandoned"))
    async for event in events:
        if event.HasField("tokens"):
            break
    await events.aclose()  # the client goes away mid-request
    await asyncio.to_thread(server.wait_for, "request.abandoned")

    async def kill_engine() -> None:
        os.kill(server.engine_pid(1), signal.SIGKILL)

    assert await first_token_then(client, "in-flight-at-kill", kill_engine) == "FINISH_REASON_ERROR"
    await asyncio.to_thread(server.wait_for, "engine.loaded", 2)
    await asyncio.to_thread(server.wait_health, "SERVING")
    after = await client.complete(
        build_request([0, 5], request_id="after-restart", max_tokens=4, ignore_eos=True)
    )
    assert after.reason == "LENGTH"


@pytest.mark.timeout(120)
async def test_every_line_of_both_processes_is_one_json_event_with_request_ids(
    tiny_llama, tmp_path
):
    log = tmp_path / "server.log"
    with server_process(log, *flags(tiny_llama, "--cpu-threads", "1")) as server:
        await asyncio.to_thread(server.wait_health, "SERVING")
        async with AsyncClient(server.target) as client:
            await workload(server, client)
        server.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(server.proc.wait, 30) == 0
    events = parse_log(log.read_text())

    engine_pids = {e["pid"] for e in events if e["process"] == "engine"}
    loaded = [e for e in events if e["event"] == "engine.loaded"]
    assert len(loaded) == 2 and {e["pid"] for e in loaded} == engine_pids, loaded
    assert all(e["process"] == "engine" and e["logger"] == "sluice.engine" for e in loaded)
    assert [e["cpu_threads"] for e in loaded] == [1, 1]  # --cpu-threads reached the engine
    assert {e["pid"] for e in events if e["process"] == "service"} == {server.proc.pid}

    refused = by_request(events, "request.refused")
    assert refused.keys() == {"refused-unary", "refused-in-stream"}
    assert {e["code"] for e in refused.values()} == {"INVALID_ARGUMENT"}
    finished = by_request(events, "request.finished")
    assert {rid: e["finish_reasons"] for rid, e in finished.items()} == {
        "streamed": ["length"],
        "cancelled-by-rpc": ["cancelled"],
        "in-flight-at-kill": ["error"],
        "after-restart": ["length"],
    }
    assert by_request(events, "request.abandoned")["abandoned"]["reason"] == "cancelled"
    # Bound per call: no request's id leaks onto a line of the server, the engine or another call.
    assert {e["event"] for e in events if "request_id" in e} == REQUEST_EVENTS


# ---- an engine that raises; the console format ----


@pytest.fixture
def broken_checkpoint(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint with its weights file overwritten: the engine raises while loading."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    return broken


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    return subprocess.run(
        [sys.executable, "-m", "service", "--port", "0", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
def test_an_engine_that_raises_logs_its_traceback_as_a_field_of_one_json_line(
    broken_checkpoint,
):
    run = run_serve(*flags(broken_checkpoint))
    assert run.returncode == 1, run.stderr
    events = parse_log(run.stderr)
    [crashed] = [e for e in events if e["event"] == "engine.crashed"]
    assert crashed["process"] == "engine" and crashed["level"] == "critical"
    assert crashed["exception"].startswith("Traceback (most recent call last):")
    assert "SafetensorError" in crashed["exception"] and "SafetensorError" in crashed["reason"]
    assert [e["process"] for e in events if e["event"] == "server.engine_failed_to_start"] == [
        "service"
    ]


@pytest.mark.timeout(90)
def test_console_format_writes_lines_for_a_person_from_both_processes(broken_checkpoint):
    run = run_serve(*flags(broken_checkpoint, "--log-format", "console"))
    assert run.returncode == 1, run.stderr
    lines = run.stderr.splitlines()
    assert not [line for line in lines if line.startswith("{")], run.stderr
    assert "\x1b[" not in run.stderr  # not a terminal: no colours
    crashed = [line for line in lines if "engine.crashed" in line]
    assert len(crashed) == 1 and "process=engine" in crashed[0], run.stderr
    assert "[critical ]" in crashed[0]
    assert any("server.engine_failed_to_start" in line for line in lines), run.stderr
    assert "Traceback (most recent call last):" in lines  # over several lines, as a person reads it
