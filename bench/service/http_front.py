"""The OpenAI front's HTTP library, chosen by measurement: aiohttp against FastAPI on uvicorn.

Each library serves the same trivial streamed completion (`POST /v1/completions` answered by
CHUNKS server-sent events of one small JSON chunk each, then `data: [DONE]`, the shape the
OpenAI front sends) from a child process of its own; one aiohttp client in this process keeps
CONCURRENCY such streams going until REQUESTS have finished. Reported per library: requests/s,
the latency of one whole stream (p50, p99), and the server's time per SSE chunk (the run's wall
time / chunks sent; the client's share is the same for both). No model: this is the library's
own overhead, which is all that differs between the two.

    python -m bench.service.http_front [--requests 400] [--concurrency 16] [--chunks 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

CHUNK = {
    "id": "cmpl-0",
    "object": "text_completion",
    "created": 0,
    "model": "tiny",
    "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}],
}


def _events(chunks: int) -> list[bytes]:
    line = b"data: " + json.dumps(CHUNK, separators=(",", ":")).encode() + b"\n\n"
    return [line] * chunks + [b"data: [DONE]\n\n"]


def serve_aiohttp(port: int, chunks: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _events(chunks):
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_fastapi(port: int, chunks: int) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        await request.json()

        async def stream() -> AsyncIterator[bytes]:
            for event in _events(chunks):
                yield event

        return StreamingResponse(stream(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def _wait_listening(port: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise TimeoutError(f"nothing listens on {port}")


async def _drive(port: int, requests: int, concurrency: int) -> dict[str, float]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    latencies: list[float] = []
    remaining = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            async with session.post(url, json={"prompt": "x", "stream": True}) as response:
                async for _ in response.content:
                    pass
            latencies.append(time.perf_counter() - start)

    async with aiohttp.ClientSession() as session:
        await worker(session)  # warm-up: connections, imports, first-call paths
        latencies.clear()
        remaining = requests
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {
        "requests_per_s": round(requests / wall, 1),
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 2),
        "latency_p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2),
        "wall_s": round(wall, 3),
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def measure(library: str, requests: int, concurrency: int, chunks: int) -> dict[str, Any]:
    target = {"aiohttp": serve_aiohttp, "fastapi+uvicorn": serve_fastapi}[library]
    port = _free_port()
    child = multiprocessing.get_context("spawn").Process(target=target, args=(port, chunks))
    child.start()
    try:
        asyncio.run(_wait_listening(port))
        result = asyncio.run(_drive(port, requests, concurrency))
    finally:
        child.terminate()
        child.join(10)
    per_chunk_us = result["wall_s"] / (requests * (chunks + 1)) * 1e6
    return {"library": library, **result, "per_chunk_us": round(per_chunk_us, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=32)
    args = parser.parse_args(argv)
    results = [
        measure(library, args.requests, args.concurrency, args.chunks)
        for library in ("aiohttp", "fastapi+uvicorn")
    ]
    print(json.dumps({"http_front": results, **vars(args)}))
    for r in results:
        print(
            f"{r['library']:>16}: {r['requests_per_s']:8.1f} req/s  p50 {r['latency_p50_ms']} ms"
            f"  p99 {r['latency_p99_ms']} ms  {r['per_chunk_us']} us/chunk",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
