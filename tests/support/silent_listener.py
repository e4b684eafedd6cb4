"""SilentListener: a TCP port that accepts connections and never answers, the hostile "trainer"
of weight-transfer join tests (c10d's TCPStore client waits on it for ever).

    with SilentListener() as listener:
        ... join 127.0.0.1:listener.port ...
        listener.accepted.wait(10)  # a client has connected

`close_connections` hangs up on every client (their waits then fail); leaving closes all.
`refused_port()` is the opposite peer: a port held where every connection is refused.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from types import TracebackType


class SilentListener:
    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self.accepted = threading.Event()  # set once the first client connects
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._clients.append(client)
            self.accepted.set()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._clients)

    def close_connections(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()

    def __enter__(self) -> SilentListener:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.close()
        self.close_connections()
        self._thread.join(5)


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port of 127.0.0.1 that refuses every connection while the block runs: bound and never
    listened on. Held, not released: a released port may be taken meanwhile by a server of
    another test (pytest-xdist runs tests side by side)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield int(probe.getsockname()[1])
