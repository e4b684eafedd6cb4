"""How fast a loaded server answers health checks, at each --service-niceness.

For each value of `--niceness` (alternating, `--repeat` times) it starts `python -m service` on
a tiny random Llama checkpoint with the engine's default torch threads (one per core), keeps
`--streams` requests of `--max-tokens` tokens running, and after a second sends `--checks`
health checks 50 ms apart, timing each. Prints their p50, p95 and max per run as JSON: a service
below an engine whose threads fill every core only runs in the engine's gaps.

    python -m bench.service.health_under_load --niceness 0 10 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, machine, percentile

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--niceness", type=int, nargs="+", default=[0, 10])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--checks", type=int, default=60)
    return p.parse_args(argv)


async def measure(target: str, args: argparse.Namespace) -> list[float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from sluice_client import AsyncClient, build_request

    stop = asyncio.Event()

    async def stream(client: Any, i: int) -> None:
        while not stop.is_set():
            request = build_request([0, 5, i], max_tokens=args.max_tokens, ignore_eos=True)
            await client.complete(request)

    async with AsyncClient(target) as client, grpc.aio.insecure_channel(target) as channel:
        load = asyncio.gather(*(stream(client, i) for i in range(args.streams)))
        await asyncio.sleep(1.0)
        health = health_pb2_grpc.HealthStub(channel)
        seconds = []
        for _ in range(args.checks):
            start = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest())
            seconds.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        stop.set()
        await load
    return seconds


def measure_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per niceness, `--repeat` times alternating: a fresh server under load, its health
    checks' latency percentiles."""
    sys.path.insert(0, str(REPO))
    from tests.support.server_process import server_process
    from tests.support.tiny_models import make_checkpoint

    runs = []
    with tempfile.TemporaryDirectory(prefix="sluice-health-") as tmp:
        model = make_checkpoint(Path(tmp) / "model", "llama")
        for _ in range(args.repeat):
            for niceness in args.niceness:
                flags = ["--model", str(model), "--device", "cpu", "--dtype", "float32"]
                flags += ["--service-niceness", str(niceness)]
                with server_process(Path(tmp) / "server.log", *flags) as server:
                    server.wait_health("SERVING")
                    seconds = asyncio.run(measure(server.target, args))
                ms = [1e3 * s for s in seconds]
                runs.append(
                    {
                        "service_niceness": niceness,
                        "health_ms_p50": percentile(ms, 50),
                        "health_ms_p95": percentile(ms, 95),
                        "health_ms_max": max(ms),
                    }
                )
    return runs


def emit_result(result: dict[str, Any]) -> None:
    header = ["niceness", "p50 ms", "p95 ms", "max ms"]
    rows = [
        [r["service_niceness"], r["health_ms_p50"], r["health_ms_p95"], r["health_ms_max"]]
        for r in result["runs"]
    ]
    emit(result, header, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = measure_runs(args)
    result = {"benchmark": "health_under_load", "settings": vars(args), "runs": runs}
    result["machine"] = machine()
    emit_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
