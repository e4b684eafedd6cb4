"""The bound on the connections the gRPC server holds, and the warning while it is reached.

Every connection holds one of the server's file descriptors, from its accept on, before any
credential is checked: a client that opens connections and never finishes the handshake
(plaintext or TLS) would otherwise hold each for gRPC's default of 120 s, and a thousand of
them exhaust `ulimit -n`: new clients are locked out, and a crashed engine cannot be restarted
("Too many open files"). So gRPC is told to close a connection whose handshake takes longer
than `handshake_timeout`, and to close at once every connection past `max_connections`, which
by default leaves some of the open-file limit to the server itself.

gRPC closes those connections without a word: `ConnectionWatch` counts the server's
connections (Linux: /proc/net/tcp) and logs `server.connections_full`, at most once per
LOG_INTERVAL_S, while they are at the bound.
"""

from __future__ import annotations

import asyncio
import resource
import time
from pathlib import Path

import structlog

from service.config import ServiceConfig

log = structlog.get_logger("sluice.server")

FD_RESERVE = 128  # descriptors kept for the server itself: engine pipes, files, metrics
CHECK_INTERVAL_S = 1.0
LOG_INTERVAL_S = 60.0
TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
HELD_STATES = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT: each still holds a descriptor here


def max_connections(config: ServiceConfig) -> int | None:
    """The connection bound: `config.max_connections`, else the soft open-file limit less
    FD_RESERVE (half of it, for a limit that small); None for an unlimited one."""
    if config.max_connections is not None:
        return config.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(soft - FD_RESERVE, soft // 2, 1)


def connection_options(config: ServiceConfig) -> list[tuple[str, int]]:
    """gRPC core's channel arguments for the handshake timeout and the connection bound."""
    options = [("grpc.server_handshake_timeout_ms", round(config.handshake_timeout * 1000))]
    limit = max_connections(config)
    if limit is not None:
        options.append(("grpc.max_allowed_incoming_connections", limit))
    return options


def held_connections(port: int) -> int | None:
    """Connections accepted on `port` that are still open, or None where the kernel's TCP
    tables cannot be read (not Linux)."""
    suffix = f":{port:04X}"
    held = 0
    try:
        for table in TCP_TABLES:
            with table.open() as lines:
                next(lines)  # the header
                for line in lines:
                    fields = line.split(maxsplit=4)
                    if fields[1].endswith(suffix) and fields[3] in HELD_STATES:
                        held += 1
    except OSError:
        return None
    return held


class ConnectionWatch:
    """Logs `server.connections_full` (a warning, at most once per LOG_INTERVAL_S) while the
    server holds `limit` connections on `port`: then gRPC closes every new one."""

    def __init__(self, port: int, limit: int, handshake_timeout: float) -> None:
        self.port = port
        self.limit = limit
        self.handshake_timeout = handshake_timeout
        self._last_log: float | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="connection-watch")
        self._task.add_done_callback(_log_failure)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            held = await asyncio.to_thread(held_connections, self.port)
            if held is None:
                return  # nothing to watch on this platform
            self.check(held)
            await asyncio.sleep(CHECK_INTERVAL_S)

    def check(self, held: int) -> None:
        now = time.monotonic()
        if held < self.limit:
            return
        if self._last_log is not None and now - self._last_log < LOG_INTERVAL_S:
            return
        self._last_log = now
        log.warning(
            "server.connections_full",
            held=held,
            max_connections=self.limit,
            handshake_timeout=self.handshake_timeout,
            reason="new connections are closed as they come until some end "
            "(--max-connections, --handshake-timeout)",
        )


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("server.connection_watch_failed", exc_info=task.exception())
