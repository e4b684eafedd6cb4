"""GenerateStream: one GenerateStream call from synchronous code (Client.stream opens it).

Requests to start and cancel are queued from any thread and sent by gRPC's request iterator in
the order they were queued; the call's events are read by iterating the stream.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from typing import Any

from sluice.v1 import generation_pb2 as pb
from sluice.v1 import generation_pb2_grpc

from sluice_client.requests import Prompt, build_request


class GenerateStream:
    """One GenerateStream call. `start`/`cancel` send (from any thread); iterate to read."""

    def __init__(
        self,
        stub: generation_pb2_grpc.GenerationStub,
        metadata: Sequence[tuple[str, str]],
        timeout: float | None,
    ) -> None:
        self._outgoing: queue.Queue[pb.GenerateStreamRequest | None] = queue.Queue()
        self.call = stub.GenerateStream(self._requests(), metadata=metadata, timeout=timeout)

    def _requests(self) -> Iterator[pb.GenerateStreamRequest]:
        while (message := self._outgoing.get()) is not None:
            yield message

    def start(self, prompt: Prompt | pb.GenerateRequest, **params: Any) -> None:
        request = (
            prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **params)
        )
        self._outgoing.put(pb.GenerateStreamRequest(start=request))

    def cancel(self, request_id: str) -> None:
        self._outgoing.put(pb.GenerateStreamRequest(cancel_request_id=request_id))

    def done_sending(self) -> None:
        self._outgoing.put(None)

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        return iter(self.call)
