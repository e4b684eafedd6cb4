"""The client processes of bench.ceiling.run: each holds its share of the streams.

With `--rpc generate` a client runs one `Generate` call per request, a request after the other
on each of its slots; with `--rpc stream` it multiplexes all its requests over one
`GenerateStream` call. Either way it records each tokens event (request id, position of its
first token, tokens, when it arrived) and when it sent each request, until `stop_at`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

Record = tuple[str, int, int, float]  # request id, position of its first token, tokens, received
Start = tuple[str, float]  # request id, when the client sent it


def client_main(
    rpc: str,
    target: str,
    slots: list[int],
    tag: str,
    prompt: list[int],
    max_tokens: int,
    start_at: float,
    stop_at: float,
    out: Any,
) -> None:
    """Hold one stream per slot until `stop_at`; put its records and starts on `out`."""
    streams = _streams if rpc == "generate" else _multiplexed
    out.put(asyncio.run(streams(target, slots, tag, prompt, max_tokens, start_at, stop_at)))


async def _streams(
    target: str,
    slots: list[int],
    tag: str,
    prompt: list[int],
    max_tokens: int,
    start_at: float,
    stop_at: float,
) -> tuple[list[Record], list[Start]]:
    import grpc
    from sluice.v1 import generation_pb2 as pb
    from sluice.v1 import generation_pb2_grpc

    records: list[Record] = []
    starts: list[Start] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await channel.channel_ready()
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))

        async def stream(slot: int) -> None:
            k = 0
            while time.monotonic() < stop_at:
                rid = f"{tag}-{slot}-{k}"
                k += 1
                request = pb.GenerateRequest(
                    request_id=rid,
                    token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(temperature=0.0),
                    stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True),
                )
                starts.append((rid, time.monotonic()))
                call = stub.Generate(request)
                position = 0
                async for event in call:
                    now = time.monotonic()
                    if event.WhichOneof("event") == "tokens":
                        count = len(event.tokens.token_ids)
                        records.append((rid, position, count, now))
                        position += count
                    if now >= stop_at:
                        call.cancel()
                        break

        await asyncio.gather(*(stream(slot) for slot in slots))
    return records, starts


async def _multiplexed(
    target: str,
    slots: list[int],
    tag: str,
    prompt: list[int],
    max_tokens: int,
    start_at: float,
    stop_at: float,
) -> tuple[list[Record], list[Start]]:
    """Like `_streams`, but every request of this client goes over one GenerateStream call."""
    import grpc
    from sluice.v1 import generation_pb2 as pb
    from sluice.v1 import generation_pb2_grpc

    records: list[Record] = []
    sent: list[Start] = []
    starts: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue()
    counts = dict.fromkeys(slots, 0)
    positions: dict[str, int] = {}

    def start(slot: int) -> None:
        rid = f"{tag}-{slot}-{counts[slot]}"
        counts[slot] += 1
        positions[rid] = 0
        request = pb.GenerateRequest(
            request_id=rid,
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0.0),
            stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True),
        )
        sent.append((rid, time.monotonic()))
        starts.put_nowait(pb.GenerateStreamRequest(start=request))

    async def requests() -> AsyncIterator[pb.GenerateStreamRequest]:
        while (message := await starts.get()) is not None:
            yield message

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await channel.channel_ready()
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        for slot in slots:
            start(slot)
        call = stub.GenerateStream(requests())
        async for event in call:
            now = time.monotonic()
            kind = event.WhichOneof("event")
            if kind == "tokens":
                count = len(event.tokens.token_ids)
                records.append((event.request_id, positions[event.request_id], count, now))
                positions[event.request_id] += count
            elif kind == "finished" and now < stop_at:
                start(int(event.request_id.split("-")[1]))
            if now >= stop_at:
                call.cancel()
                break
    return records, sent
