"""The three ways bench.service.gateway sends one streamed request, each timed the same way.

`v1`: sluice.v1 Generate over gRPC (the prompt as token ids). `openai`: Sluice's own OpenAI
front, `POST /v1/completions` with `stream` and `stream_options.include_usage` (the same token
ids as the prompt). `smg`: the same HTTP request to the SMG gateway, whose prompt is the text
(smg refuses token-id prompts and tokenizes text without special tokens, to the same ids).

The HTTP paths read server-sent events with aiohttp and parse each event's JSON, nothing more:
the client's cost per token stays about as small as the gRPC client's. TTFT is send -> the first chunk carrying output; the output tokens of an HTTP stream
are its final usage chunk's `completion_tokens`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.common import percentile


@dataclass
class Request:
    text: str
    ids: list[int]
    max_tokens: int


@dataclass
class Record:
    sent: float = 0.0
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    error: str = ""

    def first_output(self) -> None:
        if math.isnan(self.ttft):
            self.ttft = time.perf_counter() - self.sent


@dataclass
class Path:
    """Where one path sends: a sluice.v1 target (`v1`) or an OpenAI API root (the others)."""

    name: str
    target: str
    model: str = ""
    records: list[Record] = field(default_factory=list)


async def send_v1(client: Any, request: Request, temperature: float, record: Record) -> None:
    from sluice_client import build_request

    message = build_request(
        request.ids, max_tokens=request.max_tokens, temperature=temperature, ignore_eos=True
    )
    record.sent = time.perf_counter()
    try:
        async for event in client.generate(message):
            kind = event.WhichOneof("event")
            if kind == "tokens" and event.tokens.token_ids:
                record.first_output()
                record.output_tokens += len(event.tokens.token_ids)
            elif kind == "finished":
                record.latency = time.perf_counter() - record.sent
    except Exception as exc:  # a failed request is counted and reported, not fatal
        record.error = f"{type(exc).__name__}: {exc}"


async def send_http(
    http: aiohttp.ClientSession, path: Path, request: Request, temperature: float, record: Record
) -> None:
    body = {
        "model": path.model,
        "prompt": request.text if path.name == "smg" else request.ids,
        "max_tokens": request.max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record.sent = time.perf_counter()
    try:
        async with http.post(f"{path.target}/completions", json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    record.first_output()
                if chunk.get("usage"):
                    record.output_tokens = int(chunk["usage"]["completion_tokens"])
        record.latency = time.perf_counter() - record.sent
    except Exception as exc:  # a failed request is counted and reported, not fatal
        record.error = f"{type(exc).__name__}: {exc}"


def summarize(path: Path, duration: float, expected_tokens: int) -> dict[str, Any]:
    """One phase of one path: throughput, TTFT and end-to-end latency, failures."""
    ok = [r for r in path.records if not r.error]
    output = sum(r.output_tokens for r in ok)

    def stats(values: list[float]) -> dict[str, float]:
        return {"p50_ms": 1e3 * percentile(values, 50), "p99_ms": 1e3 * percentile(values, 99)}

    return {
        "path": path.name,
        "completed": len(ok),
        "failed": len(path.records) - len(ok),
        "errors": [r.error for r in path.records if r.error][:3],
        "output_tokens": output,
        "expected_output_tokens": expected_tokens,
        "duration_s": duration,
        "output_tokens_per_s": output / duration,
        "ttft": stats([r.ttft for r in ok]),
        "e2el": stats([r.latency for r in ok]),
    }
