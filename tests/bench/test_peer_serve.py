"""bench/peers/serve.py's vLLM side without vLLM: its HTTP client (bench/peers/http_stream.py) and
load generator against a stand-in OpenAI completions server on 127.0.0.1 that streams
server-sent events in a chunked body, with events split across chunks and several tokens in
one event, as a loaded server sends them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench.peers.serve import http_request, run_http_phase
from bench.service.serve import RecordHolder
from bench.workload import Workload


async def _stand_in(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    length = next(
        int(line.split(":")[1])
        for line in head.split("\r\n")
        if line.lower().startswith("content-length")
    )
    body = json.loads(await reader.readexactly(length))
    if not body.get("stream") or body["prompt"] == [0]:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nbad request")
        writer.close()
        return
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
    writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
    stream = b""
    produced = 0
    while produced < body["max_tokens"]:
        produced = min(body["max_tokens"], produced + (2 if produced == 1 else 1))
        event = {"choices": [{"text": "x"}], "usage": {"completion_tokens": produced}}
        stream += b"data: " + json.dumps(event).encode() + b"\n\n"
    stream += b"data: [DONE]\n\n"
    for start in range(0, len(stream), 37):  # chunk edges fall inside events
        piece = stream[start : start + 37]
        writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def _with_server(fn: Any) -> Any:
    server = await asyncio.start_server(_stand_in, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await fn(port)


def test_a_streamed_completion_counts_tokens_by_usage_across_chunk_edges() -> None:
    holder = RecordHolder()
    body = {"prompt": [5, 6], "max_tokens": 6, "stream": True}
    asyncio.run(_with_server(lambda port: http_request(port, body, holder)))
    rec = holder.value
    assert rec.error == ""
    assert rec.output_tokens == 6 and rec.chunks == 5  # tokens 2 and 3 came in one event
    assert 0 < rec.ttft <= rec.latency and len(rec.itl) == 4


def test_a_refused_request_is_recorded_with_its_status() -> None:
    holder = RecordHolder()
    body = {"prompt": [0], "max_tokens": 3, "stream": True}
    asyncio.run(_with_server(lambda port: http_request(port, body, holder)))
    assert "HTTP 400" in holder.value.error and holder.value.output_tokens == 0


def test_the_phase_sends_every_request_and_checks_lengths() -> None:
    workload = Workload([[1, 2], [3], [4, 5, 6]], [4, 1, 7], temperature=0.0, seed=0)
    result = asyncio.run(
        _with_server(lambda port: run_http_phase(port, "m", workload, concurrency=2))
    )
    assert (result["completed"], result["failed"], result["wrong_length"]) == (3, 0, 0)
    assert result["output_tokens"] == 12
