"""End to end: `sluice serve` yields the CPU to its engine.

The service's threads run `--service-niceness` nice levels below the priority the server was
started with; the engine process keeps that priority, also when it is restarted, because every
engine is started from the one service thread left at it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from sluice_client import AsyncClient, build_request

from service.ops.priority import yield_to_engine
from tests.support.server_process import server_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread"),
]


def nice_values(pid: int) -> list[int]:
    """The nice value of each thread of `pid` (field 19 of /proc/PID/task/TID/stat)."""
    values = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended since the listing: it has no value now
            continue
        values.append(int(stat.rsplit(")", 1)[1].split()[16]))
    return values


@pytest.mark.timeout(90)
async def test_service_threads_run_below_the_engine_also_after_a_restart(tiny_llama, tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the server inherits the test's nice value
    flags = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32"]
    with server_process(tmp_path / "server.log", *flags, "--service-niceness", "7") as server:
        await asyncio.to_thread(server.wait_health, "SERVING")
        async with AsyncClient(server.target) as client:
            done = await client.complete(build_request([0, 5], max_tokens=3, ignore_eos=True))
        assert done.reason == "LENGTH"
        service = nice_values(server.proc.pid)
        # Every thread (event loop, pipe threads, gRPC's) but the one that starts engines.
        assert sorted(service) == [base] + [min(base + 7, 19)] * (len(service) - 1)
        assert set(nice_values(server.engine_pid(1))) == {base}

        os.kill(server.engine_pid(1), signal.SIGKILL)
        await asyncio.to_thread(server.wait_for, "engine.loaded", 2)
        assert set(nice_values(server.engine_pid(2))) == {base}
        await asyncio.to_thread(server.wait_health, "SERVING")


def test_niceness_zero_changes_nothing():
    before = nice_values(os.getpid())
    assert yield_to_engine(0) is None
    assert nice_values(os.getpid()) == before
