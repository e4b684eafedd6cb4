"""The server bench.service.serve measures: `python -m service` started and awaited, and its CPU use.

`server` starts it on 127.0.0.1 port 0 with the phase's settings and yields its address once
it logs `server.listening` and its health is SERVING; `cpu_seconds` reads what the load
generator, the service process and its engine have used so far from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from service.ops.priority import Spawner, lower_priority

REPO = Path(__file__).resolve().parents[2]


def cpu_seconds(server_pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process (the load generator), the
    server process and its descendants (the engine: vLLM's engine core is a grandchild of its
    API server). Linux /proc; empty elsewhere."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = {"client": usage.ru_utime + usage.ru_stime}
    if server_pid is None or not os.path.isdir("/proc"):
        return seconds
    tick = os.sysconf("SC_CLK_TCK")
    parent, used = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # the process ended meanwhile
        fields = text[text.rindex(")") + 2 :].split()
        parent[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == server_pid:
                return True
        return False

    seconds["service"] = used.get(server_pid, 0.0)
    seconds["engine"] = sum(u for pid, u in used.items() if descends(pid))
    return seconds


@contextmanager
def server(
    args: argparse.Namespace,
    model_dir: Path,
    dtype: str,
    spawner: Spawner | None,
    extra_flags: Sequence[str] = (),
) -> Iterator[tuple[str, int]]:
    """`python -m service` on 127.0.0.1 port 0; yields (HOST:PORT, pid) once it is SERVING.

    `extra_flags` come last, so they override the defaults here. Started from `spawner`'s
    thread when given: at the priority this process had when the spawner was made."""
    cmd = [
        sys.executable,
        "-m",
        "service",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--device",
        args.device,
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(args.max_concurrency),
        "--shutdown-grace",
        "5",
        "--no-enable-prefix-cache",
        "--service-niceness",
        str(args.service_niceness),
        *extra_flags,
    ]
    env = dict(os.environ)
    if args.threads:  # the engine process inherits it: torch sizes its pool from it
        env["OMP_NUM_THREADS"] = str(args.threads)
    with logged_process(cmd, env, "sluice-serve-", spawner, grace=30) as (proc, log):
        target = wait_listening(proc, log, args.ready_timeout)
        asyncio.run(wait_serving(target, args.ready_timeout))
        # After the server started: it (and its engine) keep their priority, and so do the
        # offline runs, which `spawner` starts.
        if spawner is not None:
            lower_priority(args.client_niceness, spare=spawner.native_id)
        yield target, proc.pid


@contextmanager
def logged_process(
    cmd: Sequence[str], env: dict[str, str], prefix: str, spawner: Spawner | None, grace: float
) -> Iterator[tuple[subprocess.Popen[Any], Path]]:
    """`cmd` started (from `spawner`'s thread when given) with its output in a temporary log
    file; yields (process, log path). On an error the log's tail goes to stderr; on exit the
    process gets SIGTERM, and SIGKILL after `grace` seconds."""
    with tempfile.NamedTemporaryFile("w+", prefix=prefix, suffix=".log") as logfile:
        popen = subprocess.Popen if spawner is None else partial(spawner.run, subprocess.Popen)
        proc = popen(list(cmd), cwd=REPO, env=env, stdout=logfile, stderr=logfile)
        try:
            yield proc, Path(logfile.name)
        except BaseException:
            logfile.seek(0)
            sys.stderr.write(logfile.read()[-4000:])
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_listening(proc: subprocess.Popen[Any], path: Path, timeout: float) -> str:
    """The address the server at `proc` logged in `path` as `server.listening`; raises if it
    exits or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before listening")
        for line in path.read_text().splitlines():
            if '"server.listening"' in line:
                event = json.loads(line)
                return f"127.0.0.1:{event['port']}"
        time.sleep(0.1)
    raise TimeoutError("the server did not log server.listening in time")


async def wait_serving(target: str, timeout: float) -> None:
    """Returns once `target`'s health service answers SERVING; raises after `timeout` seconds."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("the server did not become SERVING in time")
