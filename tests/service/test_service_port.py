"""A port in use: the second server exits 1 with a clear message; the first keeps serving."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sluice_client import AsyncClient

from tests.support.server_process import run_serve
from tests.support.service_harness import make_fake_model, running_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"))


def events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


async def test_a_second_server_on_a_used_port_exits_1_before_starting_an_engine(model_dir):
    async with running_server(model_dir) as (_, target), AsyncClient(target) as client:
        port = target.rsplit(":", 1)[1]
        started = time.monotonic()
        code, stderr = await run_serve("--model", str(model_dir), "--port", port, timeout=20)
        assert code == 1, stderr
        assert time.monotonic() - started < 15
        # Only our JSON lines: gRPC core's own plain-text line about the bind is a field of ours.
        assert all(line.startswith("{") for line in stderr.splitlines()), stderr
        logged = events(stderr)
        failures = [e for e in logged if e["event"] == "server.bind_failed"]
        assert len(failures) == 1, stderr
        assert failures[0]["error"].startswith(f"cannot listen on 127.0.0.1:{port}: ")
        assert "already in use" in failures[0]["error"]
        assert "Address already in use" in failures[0]["grpc_core"]
        assert not {"server.listening", "engine.spawned"} & {e["event"] for e in logged}
        assert (await client.complete([0, 5], max_tokens=2)).reason == "LENGTH"
