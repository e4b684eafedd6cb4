"""The SMG gateway (`smg launch`, the pinned dev dependency) as a test's own process, in front of
Sluice workers that speak the vLLM worker protocol.

Everything binds 127.0.0.1 on free ports; the gateway's log goes to a file the failure messages
quote. The flags below shorten smg's health and circuit-breaker clocks (60 s between health
probes by default) so that a worker that goes down and comes back is seen within a second or
two, and make cache-aware routing exactly by prefix: no warm-up diversion (which otherwise sends
one cache hit in eight to a worker that does not hold the prefix), and each dispatch booked on
its worker's index until that worker's KV events report the pages (without it, a request sent
right after another can beat the first one's events and go by load).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

FAST_CLOCKS = [
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
    "--cb-timeout-duration-secs", "1",
    "--worker-startup-check-interval", "1",
    "--worker-warmup-secs", "0",
    "--worker-warmup-divert-every", "0",
    "--shutdown-grace-period-secs", "1",
    "--selection-accounting-ttl-ms", "5000",
]  # fmt: skip
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SmgProcess:
    """`python -m smg launch --backend vllm --policy POLICY --worker-urls grpc://W ...`."""

    def __init__(
        self,
        log_path: Path,
        workers: list[str],
        *flags: str,
        policy: str = "cache_aware",
        popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
        niceness: int = 0,
    ) -> None:
        """`workers`: "host:port" of each Sluice worker; `flags`: more `smg launch` flags;
        `popen`: what starts the process, `niceness` added to its priority (a benchmark runs
        the gateway beside the engine as it runs the service: a few nice levels below it)."""
        self.log_path = log_path
        self.port = free_port()
        self.metrics_port = free_port()
        command = ["nice", "-n", str(niceness)] if niceness else []
        command += [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--prometheus-host", "127.0.0.1"]
        command += ["--prometheus-port", str(self.metrics_port), "--backend", "vllm"]
        command += ["--policy", policy, "--worker-urls", *[f"grpc://{w}" for w in workers]]
        self._log = log_path.open("w")
        self.proc = popen(
            [*command, *FAST_CLOCKS, *flags],
            env={**os.environ, "NO_COLOR": "1"},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def base_url(self) -> str:
        """The OpenAI API's root, for `openai.OpenAI(base_url=...)`."""
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, lines: int = 40) -> str:
        text = ANSI.sub("", self.log_path.read_text(errors="replace"))
        return "\n".join(text.splitlines()[-lines:])

    def _request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")

    def wait_ready(self, model: str, timeout: float = 60.0) -> None:
        """Until `model` is listed and a one-token completion answers 200: smg lists a worker
        at registration but loads the tokenizer after it (503 until then)."""
        end = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"smg exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                status, listed = self._request("/models")
                last = listed
                if status == 200 and model in [m["id"] for m in listed["data"]]:
                    probe = {"model": model, "prompt": "ready", "max_tokens": 1}
                    status, last = self._request("/completions", probe)
                    if status == 200:
                        return
            time.sleep(0.1)
        raise AssertionError(f"smg not ready in {timeout}s (last: {last}):\n{self.log_tail()}")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of smg's samples called `name` whose labels include `labels`."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            text = page.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def healthy_workers(self) -> set[str]:
        """The "host:port" of each worker smg now routes to (GET /workers: healthy)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/workers", timeout=10) as page:
            listed = json.loads(page.read())["workers"]
        return {w["url"].removeprefix("grpc://") for w in listed if w["is_healthy"]}

    def wait_worker_healthy(self, worker: str, timeout: float = 30.0) -> None:
        """Until smg routes to `worker` again (its health probes see it serve)."""
        end = time.monotonic() + timeout
        while worker not in self.healthy_workers():
            if time.monotonic() > end:
                raise AssertionError(f"smg never saw {worker} healthy:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@contextlib.contextmanager
def smg_process(
    log_path: Path, workers: list[str], *flags: str, model: str, policy: str = "cache_aware"
) -> Iterator[SmgProcess]:
    """A gateway in front of `workers`, ready to serve `model`; stopped on the way out."""
    gateway = SmgProcess(log_path, workers, *flags, policy=policy)
    try:
        gateway.wait_ready(model)
        yield gateway
    finally:
        gateway.stop()
