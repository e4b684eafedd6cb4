"""`sluice serve` as a real subprocess, for tests that signal the server or its engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A `python -m service` child whose JSON log lines land in `log_path`."""

    def __init__(
        self, log_path: Path, *flags: str, new_session: bool = False, open_files: int | None = None
    ) -> None:
        """`new_session`: the server leads a process group of its own (its engine joins it), as a
        server started from a terminal does. `open_files`: its `ulimit -n` (soft and hard)."""
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", "0", *flags],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=new_session,
            preexec_fn=None if open_files is None else lambda: _limit_open_files(open_files),
        )

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == name:
                    found.append(event)
        return found

    def metric(self, name: str) -> float:
        """The sum of a counter's samples, scraped from the server's --metrics-port 0 page."""
        port = self.wait_for("metrics.listening")["port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            text = page.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        )

    def wait_for(self, name: str, count: int = 1, timeout: float = 60.0) -> dict[str, Any]:
        """The `count`-th log event called `name`, once it is there."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            events = self.events(name)
            if len(events) >= count:
                return events[count - 1]
            assert self.proc.poll() is None, f"the server exited: {self.log_path.read_text()}"
            time.sleep(0.05)
        raise AssertionError(f"no {name} #{count} within {timeout}s: {self.log_path.read_text()}")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.wait_for('server.listening')['port']}"

    def engine_pid(self, incarnation: int = 1) -> int:
        return int(self.wait_for("engine.spawned", incarnation)["engine_pid"])

    def health(self) -> str:
        with grpc.insecure_channel(self.target) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2.0
                )
            except grpc.RpcError as err:
                return err.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_health(self, status: str, timeout: float = 60.0) -> float:
        """Seconds until health reports `status`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.health() == status:
                return time.monotonic() - start
            time.sleep(0.1)
        raise AssertionError(f"health never {status} within {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _limit_open_files(count: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))


@contextlib.contextmanager
def server_process(
    log_path: Path, *flags: str, new_session: bool = False, open_files: int | None = None
) -> Iterator[ServerProcess]:
    server = ServerProcess(log_path, *flags, new_session=new_session, open_files=open_files)
    try:
        yield server
    finally:
        server.stop()


def is_gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie waiting to be reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if is_gone(pid):
            return True
        time.sleep(0.05)
    return False


def force_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def run_serve(*flags: str, timeout: float) -> tuple[int | None, str]:
    """`python -m service FLAGS` run to its end, for start-up failures: its exit code (None if
    it was still running after `timeout` and had to be killed) and its stderr. It has its own
    session and no stdin: a prompt (a key's password) would hang, not pass."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "service",
        *flags,
        cwd=REPO,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), timeout)
        code = process.returncode
    except TimeoutError:
        process.kill()
        _, stderr = await process.communicate()
        code = None
    return code, stderr.decode()
