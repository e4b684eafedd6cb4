"""The `sluice` command meeting a server that is not ready: its engine starting, or no server."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sluice_client import cli

from engine.protocol.config import EngineConfig
from service.config import ServiceConfig
from service.server import create_server
from tests.support.fake_engine import fake_engine_main
from tests.support.service_harness import make_fake_model

pytestmark = pytest.mark.asyncio
WAITING = "waiting for the server at"


@contextlib.asynccontextmanager
async def starting_server(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A server whose engine stays starting until the returned path is created."""
    release = tmp_path / "release"
    model = make_fake_model(tmp_path / "fake", start_when=str(release))
    engine = EngineConfig(model=str(model), device="cpu", dtype="float32", num_kv_pages=64)
    # A short pushback: gRPC's own retries of each refused call end within about a second.
    config = ServiceConfig(engine=engine, host="127.0.0.1", port=0, retry_after=0.1)
    server, port = create_server(config, fake_engine_main)
    await server.start()
    try:
        yield f"127.0.0.1:{port}", release
    finally:
        release.touch()
        await server.stop(grace=1.0)


async def test_generate_waits_for_a_starting_engine_saying_so_once(tmp_path):
    async with starting_server(tmp_path) as (target, release):
        argv = ["generate", "--target", target, "--max-tokens", "3", "abc"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sluice_client.cli", *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stderr is not None and proc.stdout is not None
        first = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
        assert first.startswith(WAITING) and "--wait-timeout" in first
        release.touch()  # only now does the engine start
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("abc") and WAITING not in err.decode()  # said once


async def test_generate_gives_up_on_a_starting_engine_after_the_wait_timeout(tmp_path, capsys):
    async with starting_server(tmp_path) as (target, _):
        argv = ["generate", "--target", target, "--wait-timeout", "1", "abc"]
        started = time.monotonic()
        code = await asyncio.to_thread(cli.main, argv)
        elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and elapsed >= 1.0
    assert err.count(WAITING) == 1 and "UNAVAILABLE: the engine is starting" in err


async def test_no_server_at_the_target_is_said_at_once_with_how_to_start_one(capsys):
    started = time.monotonic()
    code = await asyncio.to_thread(cli.main, ["generate", "--target", "127.0.0.1:1", "hi"])
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("UNAVAILABLE: no server at 127.0.0.1:1 (start one with `sluice serve")
    assert "`sluice serve --model demo --port 1`" in err
    assert elapsed < 2.0  # not the channel's ~5 s of silent retries
