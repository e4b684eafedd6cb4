"""nginx as a test's own process, running the shipped deploy/nginx/sluice.conf.

The shipped file is the tested one: only the replica addresses, the listen port and the log
directory are replaced, each by exact text that must be there. nginx runs in the foreground with
its pid file, logs and temp files in the test's directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "deploy" / "nginx" / "sluice.conf"
# The compose service names the shipped file lists, in order.
REPLICA_NAMES = ("sluice-replica-1:50051", "sluice-replica-2:50051")


def nginx_binary() -> str | None:
    """nginx on PATH or in /usr/sbin (Debian's package puts it there)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def render(replicas: list[str], port: int, log_dir: Path) -> str:
    """The shipped config with these replica addresses ("127.0.0.1:PORT"), listening on
    127.0.0.1:port and logging into log_dir."""
    assert len(replicas) == len(REPLICA_NAMES)
    text = SHIPPED.read_text()
    replacements = {
        "listen 50051 http2;": f"listen 127.0.0.1:{port} http2;",
        "/var/log/nginx/": f"{log_dir}/",
        **dict(zip(REPLICA_NAMES, replicas, strict=True)),
    }
    for old, new in replacements.items():
        assert old in text, f"deploy/nginx/sluice.conf no longer holds {old!r}"
        text = text.replace(old, new)
    return text


class NginxProcess:
    """`nginx -c <dir>/nginx.conf -p <dir> -g 'daemon off;'` in front of `replicas`."""

    def __init__(self, binary: str, directory: Path, replicas: list[str]) -> None:
        self.directory = directory
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "sluice.conf").write_text(render(replicas, self.port, directory))
        # Debian's build keeps temp files under /var/lib/nginx: every path goes to the test's
        # directory. As root, nginx would switch its workers to `nobody`, who cannot write here.
        temp = " ".join(
            f"{kind}_temp_path {directory}/{kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (directory / "nginx.conf").write_text(
            ("user root;\n" if os.geteuid() == 0 else "")
            + f"pid {directory}/nginx.pid;\n"
            + f"error_log {directory}/error.log info;\n"
            + "events {}\n"
            + f"http {{\n  {temp}\n  include {directory}/sluice.conf;\n}}\n"
        )
        self.proc = subprocess.Popen(
            [binary, "-c", str(directory / "nginx.conf"), "-p", str(directory)]
            + ["-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._wait_listening(timeout=10.0)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def access_log(self) -> list[str]:
        path = self.directory / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def _wait_listening(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"nginx exited: {self.proc.stderr.read().decode()}")  # type: ignore[union-attr]
            with contextlib.suppress(OSError), socket.create_connection(self.target_tuple, 0.2):
                return
            time.sleep(0.05)
        raise AssertionError(f"nginx is not listening on {self.target} after {timeout}s")

    @property
    def target_tuple(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: nginx's fast shutdown
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextlib.contextmanager
def nginx_process(binary: str, directory: Path, replicas: list[str]) -> Iterator[NginxProcess]:
    nginx = NginxProcess(binary, directory, replicas)
    try:
        yield nginx
    finally:
        nginx.stop()
