"""A minimal HTTP/1.1 client for OpenAI-style streaming completions, on the standard library.

bench/peers/serve.py drives vLLM's OpenAI server with it, from the same process and event loop
that drives Sluice over gRPC, so that both clients cost the machine alike and the project gains
no HTTP dependency. One connection per request (`Connection: close`); the body may be chunked
(uvicorn's streaming responses are) or sized; server-sent events are split on blank lines and
each `data:` payload is parsed as JSON until `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


class HTTPError(RuntimeError):
    pass


async def post_events(host: str, port: int, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
    """POST `body` as JSON and yield each server-sent event's parsed `data`."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode() + payload)
        await writer.drain()
        status, headers = await _read_head(reader)
        chunks = _chunked(reader) if "chunked" in headers.get("transfer-encoding", "") else None
        if status != 200:
            text = await reader.read() if chunks is None else b"".join([c async for c in chunks])
            raise HTTPError(f"HTTP {status}: {text[:500].decode(errors='replace')}")
        buffer = b""
        async for data in chunks if chunks is not None else _until_eof(reader):
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.splitlines():
                    if not line.startswith(b"data:"):
                        continue
                    value = line[5:].strip()
                    if value == b"[DONE]":
                        return
                    yield json.loads(value)
    finally:
        writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    return status, headers


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)  # the chunk and its CRLF
        yield data[:-2]


async def _until_eof(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(65536):
        yield data
