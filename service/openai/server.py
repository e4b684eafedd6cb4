"""OpenAiServer: uvicorn serving the OpenAI front in the gRPC server's own event loop.

It serves HTTPS with the gRPC port's certificate when --tls-cert-file is set, and requires
client certificates when --tls-client-ca-file is. The constructor binds the socket at once
(so a port in use fails the start like the gRPC port does); `start()` runs uvicorn on it as
a task of the running loop; `stop(timeout)` closes the
listener and idle connections, lets responses in flight end (the caller has drained the
engine first, so each stream is at its last events) for up to `timeout` seconds, then cancels
what is left. uvicorn's own signal handling is off: the service's SIGTERM handler decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator

import structlog
import uvicorn

from service.openai.app import create_app
from service.rpc.servicer import GenerationServicer

log = structlog.get_logger("sluice.openai")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn would install SIGTERM/SIGINT handlers of its own (signal.signal) and
        # re-raise them on exit, taking the signal from the service's drain.
        yield


class OpenAiServer:
    def __init__(self, servicer: GenerationServicer, host: str, port: int) -> None:
        self.host = host
        self._socket = _bind(host, port)  # raises OSError
        self.port: int = self._socket.getsockname()[1]
        tls = servicer.config
        config = uvicorn.Config(
            create_app(servicer),
            # The gRPC port's TLS, and its client certificates' CAs (mTLS), where configured.
            ssl_certfile=tls.tls_cert_file,
            ssl_keyfile=tls.tls_key_file,
            ssl_ca_certs=tls.tls_client_ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.tls_client_ca_file else ssl.CERT_NONE,
            lifespan="off",
            log_config=None,  # the service's structlog handlers format uvicorn's records
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=None,  # stop() bounds the wait itself
            # Connections and requests at once: more are answered 503 by uvicorn.
            limit_concurrency=servicer.config.max_concurrent_rpcs,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(
            self._server.serve(sockets=[self._socket]), name="openai-http"
        )
        self._task.add_done_callback(_report)

    async def stop(self, timeout: float) -> None:
        task = self._task
        if task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            self._server.force_exit = True
            for running in list(self._server.server_state.tasks):
                running.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 1.0)
        finally:
            self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _report(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("openai.server_failed", exc_info=task.exception())
