"""Builders for service tests: a fake model directory and a server on 127.0.0.1, port 0."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sluice.v1 import generation_pb2_grpc

from engine.protocol.config import EngineConfig
from service.config import ServiceConfig
from service.server import SluiceServer, create_server
from tests.support.fake_engine import fake_engine_main
from tests.support.tiny_models import make_tokenizer


def make_fake_model(directory: Path, **knobs: Any) -> Path:
    """A directory with the tiny byte-level BPE tokenizer.json and the fake engine's knobs."""
    directory.mkdir(parents=True, exist_ok=True)
    make_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "fake.json").write_text(json.dumps(knobs))
    return directory


@contextlib.asynccontextmanager
async def running_server(
    model_dir: Path, fake: bool = True, engine: dict[str, Any] | None = None, **config: Any
) -> AsyncIterator[tuple[SluiceServer, str]]:
    """A started, SERVING server and its target address; stopped (drained) on exit.

    `fake` runs tests/support/fake_engine.py instead of the real engine; `engine` overrides
    EngineConfig fields, `config` ServiceConfig fields."""
    engine_config = EngineConfig(
        **{
            "model": str(model_dir),
            "device": "cpu",
            "dtype": "float32",
            "num_kv_pages": 64,
            **(engine or {}),
        }
    )
    service_config = ServiceConfig(engine=engine_config, host="127.0.0.1", port=0, **config)
    server, port = create_server(service_config, fake_engine_main if fake else None)
    await server.start()
    try:
        await server.wait_ready(timeout=300)
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=1.0)


def stub(channel: grpc.aio.Channel) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(channel)


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return int(response.status)
