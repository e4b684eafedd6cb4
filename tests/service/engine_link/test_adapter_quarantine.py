"""An adapter load whose application kills the engine is never applied again: a real server,
a fake engine process that dies when it loads a chosen adapter (fake.json `die_on_adapter`,
as an adapter whose application crashed the real engine), real SIGKILLs. Replayed after a
restart, such a load used to kill every new engine in turn (a crash loop, never serving
again); now it is quarantined, reported, and the server serves the rest."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import grpc
import pytest
import structlog
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import admin_pb2_grpc
from sluice_client import Client
from test_service_faults import SERVING, engine_pid, wait_until

from engine.protocol.validation.adapter_config import CONFIG_FILE
from service.engine_link.engine_state import EngineState
from tests.support.adapter_calls import ADMIN_TOKEN, refusal
from tests.support.service_harness import health_status, make_fake_model, running_server


def adapter_dir(root: Path, name: str) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / CONFIG_FILE).write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (directory / "adapter_model.safetensors").write_bytes(b"")  # the fake engine reads none
    return directory


def load(target: str, name: str, path: Path) -> apb.LoadAdapterResponse:
    with grpc.insecure_channel(target) as channel:
        return admin_pb2_grpc.AdminStub(channel).LoadAdapter(
            apb.LoadAdapterRequest(name=name, path=str(path)),
            metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),),
            timeout=10,
        )


def kill_on_loading(model: Path, name: str) -> None:
    """Every engine started from now on dies when it loads the adapter `name`."""
    (model / "fake.json").write_text(json.dumps({"die_on_adapter": name}))


def complete(target: str) -> list[int]:
    with Client(target, retry=False) as client:
        return list(client.complete([0, 5, 6], max_tokens=2).token_ids)


def serving(server) -> bool:  # type: ignore[no-untyped-def]
    return server.engine.state is EngineState.SERVING


@pytest.mark.timeout(60)
async def test_a_replayed_load_that_kills_the_engine_is_quarantined_and_the_server_serves(
    tmp_path: Path,
) -> None:
    model = make_fake_model(tmp_path / "fake")
    async with running_server(
        model,
        engine={"max_loras": 2, "max_lora_rank": 16},
        admin_token=ADMIN_TOKEN,
        restart_backoff=0.1,
    ) as (server, target):
        await asyncio.to_thread(load, target, "killer", adapter_dir(tmp_path, "killer"))
        await asyncio.to_thread(load, target, "kept", adapter_dir(tmp_path, "kept"))
        kill_on_loading(model, "killer")
        with structlog.testing.capture_logs() as logs:
            os.kill(engine_pid(server), signal.SIGKILL)
            await wait_until(lambda: server.engine.restarts == 1 and serving(server), 30)
        quarantined = [e for e in logs if e["event"] == "engine.adapter_quarantined"]
        assert [e["adapter"] for e in quarantined] == ["killer"]
        failed = [e for e in logs if e["event"] == "engine.restart_failed"]
        assert len(failed) == 1  # the one engine the replay killed; the next one serves
        assert server.engine.adapters.names == {"kept"}
        registry = server.metrics.registry
        assert registry.get_sample_value("sluice_adapters_quarantined_total") == 1
        async with grpc.aio.insecure_channel(target) as channel:
            assert await health_status(channel) == SERVING
        assert await asyncio.to_thread(complete, target)
        with Client(target, retry=False) as client:
            code, fields = await asyncio.to_thread(
                refusal, lambda: client.complete([0, 5, 6], max_tokens=2, adapter="killer")
            )
        assert (code, fields) == (grpc.StatusCode.NOT_FOUND, ["adapter"])
        # A later engine loss replays only what is left.
        os.kill(engine_pid(server), signal.SIGKILL)
        await wait_until(lambda: server.engine.restarts == 2 and serving(server), 30)
        assert server.engine.adapters.names == {"kept"}


@pytest.mark.timeout(60)
async def test_a_live_load_that_kills_the_engine_fails_its_caller_and_is_never_replayed(
    tmp_path: Path,
) -> None:
    model = make_fake_model(tmp_path / "fake")
    kill_on_loading(model, "killer")
    async with running_server(
        model,
        engine={"max_loras": 2, "max_lora_rank": 16},
        admin_token=ADMIN_TOKEN,
        restart_backoff=0.1,
    ) as (server, target):
        killer = adapter_dir(tmp_path, "killer")
        code, _ = await asyncio.to_thread(refusal, lambda: load(target, "killer", killer))
        assert code == grpc.StatusCode.UNAVAILABLE
        await wait_until(lambda: server.engine.restarts == 1 and serving(server), 30)
        assert server.engine.adapters.names == frozenset()
        assert await asyncio.to_thread(complete, target)
