"""grpc.aio's own cost per streamed message: the floor under the service's.

A bare grpc.aio server (a spawned process) whose `Generate` handler waits for a tick, as the
service's handlers wait for engine steps, and yields one small GenerateResponse per tick; a
ticker wakes every stream every `--step-ms`. One client process (this one) reads `--streams`
concurrent calls. Prints the CPU seconds per message of the server process and of the client,
measured from /proc and getrusage over the second of two identical rounds (the first warms up),
and each message's delay from its tick to grpc.aio's completed write (the handler resumed after
its yield), p50 and p99: at low load the floor under the service's own arrival -> write done
(bench.ceiling.run's `service_delay_ms_*`).

    python -m bench.ceiling.grpc_floor --streams 64 --step-ms 5 --messages 200
    python -m bench.ceiling.grpc_floor --streams 4 --step-ms 20 --messages 250   # low load
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import time
from pathlib import Path
from typing import Any

from bench.common import emit, machine, percentile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--messages", type=int, default=200, help="per stream per round")
    return p.parse_args(argv)


def server_main(port_out: Any, delays_out: Any, step_s: float, messages: int) -> None:
    import grpc
    from sluice.v1 import generation_pb2 as pb
    from sluice.v1 import generation_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.GenerationServicer):
        def __init__(self) -> None:
            self.ticks: list[asyncio.Queue[None]] = []
            self.ticked_at = 0.0

        async def Generate(self, request: Any, context: Any) -> Any:
            tick: asyncio.Queue[None] = asyncio.Queue()
            self.ticks.append(tick)
            delays: list[float] = []
            try:
                for i in range(messages):
                    await tick.get()
                    ticked_at = self.ticked_at
                    chunk = pb.TokenChunk(token_ids=[i], text="ab")
                    yield pb.GenerateResponse(request_id=request.request_id, tokens=chunk)
                    # resumed by grpc.aio once the message is written
                    delays.append(time.monotonic() - ticked_at)
            finally:
                self.ticks.remove(tick)
                delays_out.put(delays)

    async def serve() -> None:
        server = grpc.aio.server()
        servicer = Servicer()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.put(port)
        while True:
            await asyncio.sleep(step_s)
            servicer.ticked_at = time.monotonic()
            for tick in servicer.ticks:
                tick.put_nowait(None)

    asyncio.run(serve())


async def read_streams(target: str, streams: int) -> int:
    import grpc
    from sluice.v1 import generation_pb2 as pb
    from sluice.v1 import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> int:
            return sum([1 async for _ in stub.Generate(pb.GenerateRequest(request_id=str(i)))])

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """A warm-up round, then one timed round of every stream against a spawned bare server:
    the messages read, the wall time, each side's CPU seconds and every tick -> written delay."""
    ctx = multiprocessing.get_context("spawn")
    port_out, delays_out = ctx.Queue(), ctx.Queue()
    server = ctx.Process(
        target=server_main,
        args=(port_out, delays_out, args.step_ms / 1000, args.messages),
        daemon=True,
    )
    server.start()
    try:
        target = f"127.0.0.1:{port_out.get(timeout=60)}"
        asyncio.run(read_streams(target, args.streams))  # warm-up round
        for _ in range(args.streams):
            delays_out.get(timeout=60)
        assert server.pid is not None
        server_before = cpu_seconds(server.pid)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        client_before = usage.ru_utime + usage.ru_stime
        start = time.perf_counter()
        messages = asyncio.run(read_streams(target, args.streams))
        wall = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        client = usage.ru_utime + usage.ru_stime - client_before
        server_cpu = cpu_seconds(server.pid) - server_before
        delays = [d for _ in range(args.streams) for d in delays_out.get(timeout=60)]
    finally:
        server.kill()
    return {"messages": messages, "wall": wall, "client": client, "server": server_cpu,
            "delays": delays}  # fmt: skip


def summarize(args: argparse.Namespace, m: dict[str, Any]) -> dict[str, Any]:
    messages, wall = m["messages"], m["wall"]
    return {
        "benchmark": "grpc_floor",
        "streams": args.streams,
        "step_ms": args.step_ms,
        "messages": messages,
        "messages_per_s": messages / wall,
        "server_us_per_message": 1e6 * m["server"] / messages,
        "client_us_per_message": 1e6 * m["client"] / messages,
        "server_cores": m["server"] / wall,
        "write_ms_p50": 1000 * percentile(m["delays"], 50),
        "write_ms_p99": 1000 * percentile(m["delays"], 99),
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    header = ["streams", "step ms", "msg/s", "server us/msg", "client us/msg"]
    header += ["tick -> written p50 ms", "p99"]
    row = [result["streams"], result["step_ms"], result["messages_per_s"]]
    row += [result["server_us_per_message"], result["client_us_per_message"]]
    emit(result, header, [[*row, result["write_ms_p50"], result["write_ms_p99"]]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    emit_result(summarize(args, measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
