"""Client: the Generation service from synchronous code (scripts, notebooks, the CLI)."""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
from sluice.v1 import generation_pb2 as pb
from sluice.v1 import generation_pb2_grpc

from sluice_client.requests import Collector, Completion, build_request

Prompt = str | Sequence[int]


class Client:
    """`with Client("host:port") as client: for event in client.generate("Hello"): ...`.

    Keyword arguments of `generate`/`complete`/`generate_many` are those of `build_request`.
    """

    def __init__(
        self, target: str, *, api_token: str | None = None, channel: grpc.Channel | None = None
    ) -> None:
        self.channel = channel or grpc.insecure_channel(target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.metadata = () if api_token is None else (("authorization", f"Bearer {api_token}"),)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(
        self, prompt: Prompt | pb.GenerateRequest, *, timeout: float | None = None, **params: Any
    ) -> Iterator[pb.GenerateResponse]:
        """The events of one request, as they arrive. Closing the iterator cancels the call."""
        request = (
            prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **params)
        )
        call = self.stub.Generate(request, metadata=self.metadata, timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the call has ended

    def complete(
        self, prompt: Prompt | pb.GenerateRequest, *, timeout: float | None = None, **params: Any
    ) -> Completion:
        collector = Collector()
        completion: Completion | None = None
        for event in self.generate(prompt, timeout=timeout, **params):
            completion = collector.add(event)
        assert completion is not None, "the server sent no events"
        return completion

    def stream(self, *, timeout: float | None = None) -> GenerateStream:
        return GenerateStream(self.stub, self.metadata, timeout)

    def generate_many(
        self, prompts: Iterable[Prompt | pb.GenerateRequest], **params: Any
    ) -> Iterator[pb.GenerateResponse]:
        """Every prompt over one GenerateStream; events of all requests, interleaved."""
        stream = self.stream()
        for prompt in prompts:
            stream.start(prompt, **params)
        stream.done_sending()
        yield from stream

    def cancel(self, request_ids: Iterable[str]) -> pb.CancelResponse:
        return self.stub.Cancel(
            pb.CancelRequest(request_ids=list(request_ids)), metadata=self.metadata
        )

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, metadata=self.metadata).token_ids)

    def info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self.metadata)


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
