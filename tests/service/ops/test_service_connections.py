"""Connections that hold a descriptor without a credential: `sluice serve` as a real process.

Raw TCP sockets that send nothing, or half a TLS ClientHello, are closed once
`--handshake-timeout` has passed; past `--max-connections` a new one is closed at once (and the
server says so in one rate-limited warning); a flood of them under a small `ulimit -n` leaves a
crashed engine restartable; a real client is served beside idle sockets.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sluice_client import Client, TlsConfig
from test_service_tls import Pki, make_pki

from tests.support.server_process import ServerProcess, server_process

pytestmark = pytest.mark.slow

# A TLS record header announcing a 512-byte handshake message, and the first bytes of it.
PARTIAL_CLIENT_HELLO = bytes.fromhex("1603010200010001fc0303")


def flags(model: Path, *extra: str) -> tuple[str, ...]:
    return ("--model", str(model), "--device", "cpu", "--dtype", "float32", *extra)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(
    tiny_llama: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    tls = ("--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key))
    log = tmp_path_factory.mktemp("tls") / "server.log"
    with server_process(log, *flags(tiny_llama, *tls, "--handshake-timeout", "1")) as server:
        server.wait_for("server.serving")
        yield server


def port_of(server: ServerProcess) -> int:
    return int(server.wait_for("server.listening")["port"])


@contextlib.contextmanager
def raw_sockets(port: int, count: int, first_bytes: bytes = b"") -> Iterator[list[socket.socket]]:
    """`count` TCP connections to `port` that send `first_bytes` and then nothing."""
    opened = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if first_bytes:
                sock.sendall(first_bytes)
            opened.append(sock)
        yield opened
    finally:
        for sock in opened:
            sock.close()


def seconds_until_closed(sockets: list[socket.socket], limit: float) -> list[float | None]:
    """For each socket, the seconds until the server closed it (EOF or a reset; whatever it
    sent before is read and dropped), or None if it was still open after `limit` seconds."""
    start = time.monotonic()
    closed: list[float | None] = [None] * len(sockets)
    with selectors.DefaultSelector() as selector:
        for i, sock in enumerate(sockets):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, i)
        while selector.get_map() and (left := start + limit - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                sock, i = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(65536):
                        continue  # the server's HTTP/2 SETTINGS or GOAWAY: not closed yet
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    pass
                closed[i] = time.monotonic() - start
                selector.unregister(sock)
    return closed


@pytest.mark.timeout(60)
def test_connections_that_never_finish_the_tls_handshake_are_closed_within_the_timeout(
    tls_server,
):
    port = port_of(tls_server)
    with (
        raw_sockets(port, 10) as silent,
        raw_sockets(port, 10, PARTIAL_CLIENT_HELLO) as half_hello,
    ):
        # gRPC's own default would hold each for 120 s.
        closed = seconds_until_closed(silent + half_hello, limit=10)
    assert all(t is not None and t < 4 for t in closed), closed


@pytest.mark.timeout(60)
def test_a_tls_client_is_served_while_idle_connections_are_open(tls_server, pki):
    port = port_of(tls_server)
    with raw_sockets(port, 50), Client(tls_server.target, tls=TlsConfig(ca_file=pki.ca)) as client:
        completion = client.complete([0, 5, 6], max_tokens=3, ignore_eos=True, timeout=20)
    assert completion.reason == "LENGTH"


@pytest.mark.timeout(90)
def test_connections_past_the_bound_are_closed_at_once_and_logged_once(tiny_llama, tmp_path):
    bound = ("--max-connections", "8", "--handshake-timeout", "4")
    with server_process(tmp_path / "server.log", *flags(tiny_llama, *bound)) as server:
        server.wait_for("server.serving")
        port = port_of(server)
        with raw_sockets(port, 8) as held, raw_sockets(port, 5) as extra:
            refused = seconds_until_closed(extra, limit=2)
            # Held for the handshake timeout: the watch sees the bound reached at each check.
            closed = seconds_until_closed(held, limit=10)
        full = server.events("server.connections_full")
    assert all(t is not None and t < 1 for t in refused), refused
    assert all(t is not None for t in closed), closed
    assert len(full) == 1 and full[0]["max_connections"] == 8, full


@pytest.mark.timeout(120)
def test_a_connection_flood_under_a_small_ulimit_leaves_the_engine_restartable(
    tiny_llama, tmp_path
):
    # ulimit -n 512: the default bound is 384 connections, and the flood is larger than the
    # limit itself; each connection would be held for 60 s.
    slow = ("--handshake-timeout", "60", "--restart-backoff", "0.1")
    log = tmp_path / "server.log"
    with server_process(log, *flags(tiny_llama, *slow), open_files=512) as server:
        server.wait_for("server.serving")
        assert server.wait_for("server.listening")["max_connections"] == 384
        with raw_sockets(port_of(server), 600):
            os.kill(server.engine_pid(), signal.SIGKILL)
            server.wait_for("engine.ready", 2, timeout=60)  # spawned and loaded: files opened
        server.wait_health("SERVING")
        with Client(server.target) as client:
            completion = client.complete([0, 5, 6], max_tokens=3, ignore_eos=True, timeout=20)
    assert completion.reason == "LENGTH"
    assert not [line for line in log.read_text().splitlines() if "Too many open files" in line]
