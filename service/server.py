"""The gRPC server: Generation, Admin, grpc.health.v1, reflection, auth; startup and shutdown.

`create_server(config) -> (server, port)` builds and binds everything without starting it;
`serve(config)` runs it until SIGTERM/SIGINT. Never imports torch (a test asserts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sluice.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from service.admin import AdminServicer
from service.auth import BearerTokenInterceptor
from service.config import ServiceConfig
from service.decoding import DecodingInterceptor
from service.engine_client import EngineClient, EngineStartError, EngineState, EngineTarget
from service.servicer import GenerationServicer
from service.tokenizer import Tokenizer

log = structlog.get_logger("sluice.server")

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
HEALTH_SERVICES = ("", GENERATION_SERVICE)
FINAL_FLUSH_S = 2.0  # after the engine stops: time for handlers to send their final events
MAX_SEND_MESSAGE_BYTES = 64 * 1024 * 1024  # a chunk of many tokens with top logprobs


class SluiceServer:
    """The grpc.aio server plus the engine it fronts. `start` returns at once; health turns
    SERVING when the engine is Ready and its tokenizer loaded (`wait_ready` waits for that)."""

    def __init__(self, config: ServiceConfig, engine_target: EngineTarget | None = None) -> None:
        self.config = config
        extra = {} if engine_target is None else {"target": engine_target}
        self.engine = EngineClient(
            config.engine,
            ready_timeout=config.ready_timeout,
            heartbeat_timeout=config.heartbeat_timeout,
            stall_timeout=config.stall_timeout,
            restart_backoff=config.restart_backoff,
            restart_backoff_max=config.restart_backoff_max,
            on_state=self._on_engine_state,
            **extra,
        )
        self.servicer = GenerationServicer(config, self.engine)
        self.admin = AdminServicer(config, self.engine, lambda: self.servicer.draining)
        self.health = health.aio.HealthServicer()
        # Always installed: with no admin token it is what refuses Admin (PERMISSION_DENIED).
        auth = BearerTokenInterceptor(config.api_token, config.admin_token)
        self.grpc = grpc.aio.server(
            # In this order: a caller without the token gets its refusal before any parsing.
            interceptors=[auth, DecodingInterceptor()],
            options=[
                # Larger messages are refused (RESOURCE_EXHAUSTED) before they are parsed.
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
            ],
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.grpc)
        admin_pb2_grpc.add_AdminServicer_to_server(self.admin, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.grpc,
        )
        self.ready = asyncio.Event()
        self._startup: asyncio.Task[None] | None = None
        self._health_updates: set[asyncio.Task[None]] = set()

    def bind(self) -> int:
        port = self.grpc.add_insecure_port(self.config.address)
        if port == 0:
            raise OSError(f"could not bind {self.config.address}")
        return port

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        self._startup = asyncio.create_task(self._start_engine(), name="engine-startup")

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until SERVING; raises EngineStartError if the engine never came up."""
        assert self._startup is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._startup), timeout)

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()

    async def _start_engine(self) -> None:
        info = await self.engine.start()
        self.servicer.tokenizer = await asyncio.to_thread(Tokenizer, info.path)
        self.ready.set()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("server.serving", model=info.model, max_model_len=info.max_model_len)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new requests, let in-flight ones finish for up to
        `grace` seconds, then stop the engine (what is left ends ABORTED) and the server."""
        grace = self.config.shutdown_grace if grace is None else grace
        self.servicer.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("server.draining", in_flight=self.engine.in_flight, grace=grace)
        end = time.monotonic() + grace
        while self.engine.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineStartError):
                await self._startup
        await self.engine.shutdown()
        # NOTE: server.stop(grace) cuts streams still running when grace ends, so the engine
        # is stopped first and the handlers only need to flush their final events.
        await self.grpc.stop(FINAL_FLUSH_S)
        for task in list(self._health_updates):
            task.cancel()
        log.info("server.stopped")

    def _on_engine_state(self, state: EngineState) -> None:
        serving = (
            state is EngineState.SERVING
            and self.servicer.tokenizer is not None
            and not self.servicer.draining
        )
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        task = asyncio.create_task(self._set_health(status))
        self._health_updates.add(task)
        task.add_done_callback(self._health_update_done)

    def _health_update_done(self, task: asyncio.Task[None]) -> None:
        self._health_updates.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("server.health_update_failed", exc_info=task.exception())

    async def _set_health(
        self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None:
        for service in HEALTH_SERVICES:
            await self.health.set(service, status)


def create_server(
    config: ServiceConfig, engine_target: EngineTarget | None = None
) -> tuple[SluiceServer, int]:
    """Build the server and bind its port (port 0 picks a free one); `start()` runs it.

    Must be called with a running event loop (grpc.aio binds the server to it)."""
    server = SluiceServer(config, engine_target)
    return server, server.bind()


async def serve(config: ServiceConfig) -> int:
    """Run until SIGTERM or SIGINT, then drain and stop. Returns the process exit code."""
    server, port = create_server(config)
    await server.start()
    log.info("server.listening", host=config.host, port=port, address=f"{config.host}:{port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    assert server._startup is not None
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({stopping, server._startup}, return_when=asyncio.FIRST_COMPLETED)
    if server._startup in done and server._startup.exception() is not None:
        log.error("server.engine_failed_to_start", error=str(server._startup.exception()))
        stopping.cancel()
        await server.stop(grace=0)
        return 1
    await stopping
    log.info("server.signal", action="draining")
    await server.stop()
    return 0
