"""The gRPC server: Generation, Admin, the vLLM worker protocol (VllmEngine), grpc.health.v1,
reflection, auth; startup and shutdown.

`create_server(config) -> (server, port)` builds and binds everything without starting it;
`serve(config)` runs it until SIGTERM/SIGINT. Never imports torch (a test asserts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sluice.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from service.config import MAX_SEND_MESSAGE_BYTES, ServiceConfig
from service.engine_link.engine_client import EngineClient
from service.engine_link.engine_process import EngineStartError, EngineTarget, StartProcess
from service.engine_link.engine_state import EngineState
from service.ops.connections import ConnectionWatch, connection_options, max_connections
from service.ops.grpc_core_log import grpc_core_log
from service.ops.metrics import Gauges, Metrics
from service.ops.metrics_http import MetricsHttpServer
from service.ops.priority import yield_to_engine
from service.ops.tls import TlsError, server_credentials
from service.rpc.admin import AdminServicer
from service.rpc.auth import BearerTokenInterceptor
from service.rpc.call_limit import CallLimit
from service.rpc.call_metrics import CallMetrics
from service.rpc.decoding import DecodingInterceptor
from service.rpc.servicer import GenerationServicer
from service.text.chat_template import ChatTemplate
from service.text.tokenizer import Tokenizer
from service.vllm_worker.pb import vllm_engine_pb2_grpc
from service.vllm_worker.servicer import SERVICE_NAME as VLLM_ENGINE_SERVICE
from service.vllm_worker.servicer import VllmEngineServicer

if TYPE_CHECKING:
    from service.openai.server import OpenAiServer

log = structlog.get_logger("sluice.server")

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
HEALTH_SERVICES = ("", GENERATION_SERVICE, VLLM_ENGINE_SERVICE)
REFLECTED_SERVICES = (
    GENERATION_SERVICE,
    ADMIN_SERVICE,
    VLLM_ENGINE_SERVICE,
    health.SERVICE_NAME,
    reflection.SERVICE_NAME,
)
FINAL_FLUSH_S = 2.0  # after the engine stops: time for handlers to send their final events
# NOTE: gRPC core keeps calls that no handler has picked up yet in a pending queue. Past 1,000 of
# them (certainly past 3,000) it cancels new ones at random, and it cancels any that waited
# there 30 s: the caller sees CANCELLED and nothing is logged. Core must never shed load;
# CallLimit does, with RESOURCE_EXHAUSTED, and the caller's deadline bounds the wait.
UNBOUNDED = 2**31 - 1
CORE_PENDING_OPTIONS = [
    ("grpc.server.max_pending_requests", UNBOUNDED),
    ("grpc.server.max_pending_requests_hard_limit", UNBOUNDED),
    ("grpc.server_max_unrequested_time_in_server", UNBOUNDED),  # seconds
]


class BindError(OSError):
    """The server cannot listen on its address."""

    def __init__(self, address: str, reason: str, grpc_core: str = "") -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address
        self.grpc_core = grpc_core  # what gRPC's C core said about it, if anything


class SluiceServer:
    """The grpc.aio server plus the engine it fronts. `start` returns at once; health turns
    SERVING when the engine is Ready and its tokenizer loaded (`wait_ready` waits for that)."""

    def __init__(
        self,
        config: ServiceConfig,
        engine_target: EngineTarget | None = None,
        start_process: StartProcess | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics(config.engine.speculative_method)
        extra: dict[str, Any] = {} if engine_target is None else {"target": engine_target}
        if start_process is not None:
            extra["start_process"] = start_process
        self.engine = EngineClient(config, self.metrics, on_state=self._on_engine_state, **extra)
        self.servicer = GenerationServicer(config, self.engine, self.metrics)
        self.admin = AdminServicer(
            config, self.engine, self.metrics, lambda: self.servicer.draining
        )
        self.vllm_engine = VllmEngineServicer(config, self.servicer)
        self.metrics.watch(self._gauges)
        self.metrics_http: MetricsHttpServer | None = None  # bound by bind() when configured
        self.openai: OpenAiServer | None = None  # bound by bind() with --openai-port
        self.health = health.aio.HealthServicer()
        # Always installed: with no admin token it is what refuses Admin (PERMISSION_DENIED).
        auth = BearerTokenInterceptor(config.api_token, config.admin_token)
        # After auth: a call refused for its token never takes a slot.
        self.call_limit = CallLimit(
            config.max_concurrent_rpcs, config.retry_after, config.generate_streams_per_connection
        )
        self.grpc = grpc.aio.server(
            # In this order: every call is counted, refused ones included; a caller without the
            # token is refused before it takes a slot or is parsed; a call over the limit is
            # refused before it is parsed.
            interceptors=[CallMetrics(self.metrics), auth, self.call_limit, DecodingInterceptor()],
            options=[
                # Larger messages are refused (RESOURCE_EXHAUSTED) before they are parsed.
                ("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
                *CORE_PENDING_OPTIONS,
                *_connection_options(config),
                *connection_options(config),  # the handshake timeout, the connection bound
                # A second server on a used port must fail, not share it: the two would split
                # the connections, so a Cancel or UpdateWeights would reach only one of them.
                ("grpc.so_reuseport", 0),
            ],
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.grpc)
        admin_pb2_grpc.add_AdminServicer_to_server(self.admin, self.grpc)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm_engine, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(REFLECTED_SERVICES, self.grpc)
        self.ready = asyncio.Event()
        self._startup: asyncio.Task[None] | None = None
        self._health_updates: set[asyncio.Task[None]] = set()
        self._connection_watch: ConnectionWatch | None = None

    def bind(self) -> int:
        """Listen on the configured address, and the metrics one when configured; raises
        TlsError if a TLS file is unusable, BindError if an address cannot be bound (in use,
        say). Returns the gRPC port. Health and reflection share the port, and its TLS."""
        credentials = server_credentials(self.config)  # before binding: nothing half started
        failure: RuntimeError | None = None
        with grpc_core_log() as core_lines:  # its plain-text line would break stderr's JSON
            try:
                if credentials is None:
                    port = self.grpc.add_insecure_port(self.config.address)
                else:
                    port = self.grpc.add_secure_port(self.config.address, credentials)
            except RuntimeError as exc:  # gRPC says only that it failed, not why
                failure = exc
        if failure is not None:
            reason = _bind_failure(self.config)
            raise BindError(self.config.address, reason, "\n".join(core_lines)) from failure
        if core_lines:
            log.warning("server.grpc_core", lines=core_lines)
        limit = max_connections(self.config)
        if limit is not None:
            self._connection_watch = ConnectionWatch(port, limit, self.config.handshake_timeout)
        if self.config.metrics_port is not None:
            host, metrics_port = self.config.metrics_host, self.config.metrics_port
            try:
                self.metrics_http = MetricsHttpServer(self.metrics.registry, host, metrics_port)
            except OSError as exc:
                raise _http_bind_error(exc, f"{host}:{metrics_port} (metrics)") from exc
        if self.config.openai_port is not None:
            # NOTE: imported here: FastAPI's import is half of the service's start-up import
            # time (0.35 of 0.66 s), paid only by a server that has the port.
            from service.openai.server import OpenAiServer

            host, openai_port = self.config.openai_host, self.config.openai_port
            try:
                self.openai = OpenAiServer(self.servicer, host, openai_port)
            except OSError as exc:
                raise _http_bind_error(exc, f"{host}:{openai_port} (openai)") from exc
        return port

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        if self._connection_watch is not None:
            self._connection_watch.start()
        if self.metrics_http is not None:
            self.metrics_http.start()
        if self.openai is not None:
            self.openai.start()
        self._startup = asyncio.create_task(self._start_engine(), name="engine-startup")

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until SERVING; raises EngineStartError if the engine never came up."""
        assert self._startup is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._startup), timeout)

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()

    async def _start_engine(self) -> None:
        info = await self.engine.start()
        # NOTE: the template first: a request sees the tokenizer only with its template.
        self.servicer.chat_template = await asyncio.to_thread(
            ChatTemplate.load, info.path, self.config.chat_template
        )
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
        await self.engine.shutdown(timeout=self.config.engine_exit_timeout)
        # NOTE: server.stop(grace) cuts streams still running when grace ends, so the engine
        # is stopped first and the handlers only need to flush their final events.
        await asyncio.gather(
            self.grpc.stop(FINAL_FLUSH_S),
            *([self.openai.stop(FINAL_FLUSH_S)] if self.openai is not None else []),
        )
        for task in list(self._health_updates):
            task.cancel()
        if self._connection_watch is not None:
            self._connection_watch.stop()
        if self.metrics_http is not None:
            await asyncio.to_thread(self.metrics_http.stop)
        log.info("server.stopped")

    def _gauges(self) -> Gauges:
        """Read on the metrics thread at each scrape: attribute reads only."""
        stats = self.engine.stats
        in_use = stats.total_pages - stats.free_pages - stats.cached_pages
        state = generation_pb2.ServingState.Name(self.servicer.serving_state())
        return Gauges(
            running=stats.running,
            waiting=stats.waiting,
            kv_cache_usage=in_use / stats.total_pages if stats.total_pages else 0.0,
            policy_version=self.engine.policy_version,
            serving_state=state.removeprefix("SERVING_STATE_").lower(),
            engine_up=self.engine.state is EngineState.SERVING,
            max_loras=self.config.engine.max_loras,
            running_adapters=stats.running_adapters,
            waiting_adapters=stats.waiting_adapters,
        )

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


def _http_bind_error(exc: OSError, address: str) -> BindError:
    """An HTTP port (metrics, OpenAI) that could not be bound, with why."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        reason += " (is another server running on this port?)"
    return BindError(address, reason)


def _bind_failure(config: ServiceConfig) -> str:
    """Why the address cannot be bound, found by binding a plain socket to it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            config.host.strip("[]"), config.port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            reason += " (is another server running on this port?)"
        return reason
    return "gRPC could not bind it"


def create_server(
    config: ServiceConfig,
    engine_target: EngineTarget | None = None,
    start_process: StartProcess | None = None,
) -> tuple[SluiceServer, int]:
    """Build the server and bind its port (port 0 picks a free one); `start()` runs it.

    Must be called with a running event loop (grpc.aio binds the server to it)."""
    server = SluiceServer(config, engine_target, start_process)
    return server, server.bind()


async def serve(config: ServiceConfig) -> int:
    """Run until SIGTERM or SIGINT, then drain and stop. Returns the process exit code."""
    spawner = yield_to_engine(config.service_niceness)
    start_process = None if spawner is None else spawner.start
    try:
        server, port = create_server(config, start_process=start_process)
    except BindError as exc:
        log.error(
            "server.bind_failed", address=exc.address, error=str(exc), grpc_core=exc.grpc_core
        )
        return 1
    except TlsError as exc:
        log.error("server.tls_invalid", error=str(exc))
        return 1
    await server.start()
    log.info(
        "server.listening",
        host=config.host,
        port=port,
        address=f"{config.host}:{port}",
        tls=config.tls_mode,
        max_connections=max_connections(config),
        openai_port=None if server.openai is None else server.openai.port,
    )
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


def _connection_options(config: ServiceConfig) -> list[tuple[str, int]]:
    """Keepalive pings and the per-connection stream limit, from the config's seconds."""
    options = [
        ("grpc.keepalive_time_ms", round(config.keepalive_time * 1000)),
        ("grpc.keepalive_timeout_ms", round(config.keepalive_timeout * 1000)),
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            round(config.keepalive_min_ping_interval * 1000),
        ),
        # Clients may ping an idle connection (no call in flight) too, at the interval above.
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if config.max_concurrent_streams is not None:
        options.append(("grpc.max_concurrent_streams", config.max_concurrent_streams))
    return options
