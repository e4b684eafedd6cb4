"""AsyncClient: the Generation service from asyncio code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Literal, overload

import grpc
from sluice.v1 import generation_pb2 as pb
from sluice.v1 import generation_pb2_grpc

from sluice_client.affinity import with_affinity
from sluice_client.channels import TlsConfig, aio_secure_or_insecure
from sluice_client.requests import (
    Collector,
    Completion,
    Prompt,
    build_request,
    chat_prompt,
    samples_asked,
)
from sluice_client.retry import Retry, channel_options


class AsyncClient:
    """`async with AsyncClient("host:port") as client: async for event in client.generate(...)`.

    Keyword arguments of `generate`/`complete`/`generate_many` are those of `build_request`.
    `tls` (a TlsConfig) connects over TLS, as for Client.
    `retry`: as for `Client` (gRPC retries refused Generation calls unless False).
    `affinity`: as for `Client`, the routing key for a load balancer (`x-sluice-affinity`);
    `generate`, `complete`, `stream`, `generate_many` and `cancel` take their own, which wins.
    """

    def __init__(
        self,
        target: str,
        *,
        api_token: str | None = None,
        tls: TlsConfig | None = None,
        channel: grpc.aio.Channel | None = None,
        retry: Retry = True,
        affinity: str | None = None,
    ) -> None:
        self.channel = channel or aio_secure_or_insecure(target, tls, channel_options(retry))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._api_metadata: tuple[tuple[str, str], ...] = (
            () if api_token is None else (("authorization", f"Bearer {api_token}"),)
        )
        self.metadata = with_affinity(self._api_metadata, affinity)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The events of one request, as they arrive: started, token chunks, finished."""
        request = (
            prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **params)
        )
        metadata = self._call_metadata(affinity)
        call = self.stub.Generate(request, metadata=metadata, timeout=timeout)
        try:
            async for event in call:
                yield event
        finally:
            call.cancel()  # closing the iterator early cancels the call; a no-op once ended

    @overload
    async def complete(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        n: Literal[1] | None = None,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> Completion: ...

    @overload
    async def complete(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        n: int,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> Completion | list[Completion]: ...

    async def complete(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        n: int | None = None,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> Completion | list[Completion]:
        """One request's events put together: as for `Client.complete`, its Completion (n = 1)
        or the list of its n Completions in index order (n > 1)."""
        if n is not None:
            params["n"] = n
        collector = Collector()
        async for event in self.generate(prompt, timeout=timeout, affinity=affinity, **params):
            collector.add(event)
        return collector.of_one_request(samples_asked(prompt, params))

    def stream(
        self, *, timeout: float | None = None, affinity: str | None = None
    ) -> AsyncGenerateStream:
        """A GenerateStream: start and cancel many requests over one call, read all events.
        Behind a balancer the whole call goes to one replica (a key picks which)."""
        return AsyncGenerateStream(self.stub, self._call_metadata(affinity), timeout)

    async def generate_many(
        self,
        prompts: Iterable[Prompt | pb.GenerateRequest],
        *,
        affinity: str | None = None,
        **params: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Every prompt over one GenerateStream; events of all requests, interleaved."""
        stream = self.stream(affinity=affinity)
        for prompt in prompts:
            await stream.start(prompt, **params)
        await stream.done_sending()
        async for event in stream:
            yield event

    async def cancel(
        self, request_ids: Iterable[str], *, affinity: str | None = None
    ) -> pb.CancelResponse:
        """Behind a balancer, reaches the replica running the requests only with the affinity
        key they were sent with (the others answer `not_found`)."""
        request = pb.CancelRequest(request_ids=list(request_ids))
        return await self.stub.Cancel(request, metadata=self._call_metadata(affinity))

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        response = await self.stub.Tokenize(request, metadata=self.metadata)
        return list(response.token_ids)

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]] | pb.ChatPrompt,
        *,
        timeout: float | None = None,
        **chat_options: Any,
    ) -> pb.RenderChatResponse:
        """The server's rendering of a chat: its `text` and `token_ids`, as a Generate with
        this chat would use them. `chat_options`: those of `chat_prompt` (tools,
        add_generation_prompt, continue_final_message, template_kwargs)."""
        request = pb.RenderChatRequest(chat=chat_prompt(messages, **chat_options))
        return await self.stub.RenderChat(request, metadata=self.metadata, timeout=timeout)

    async def info(self) -> pb.ServerInfo:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self.metadata)

    def _call_metadata(self, affinity: str | None) -> tuple[tuple[str, str], ...]:
        """The metadata of a Generation call: a call's own key wins over the client's."""
        if affinity is None:
            return self.metadata
        return with_affinity(self._api_metadata, affinity)


class AsyncGenerateStream:
    """One GenerateStream call. `start`/`cancel` send; iterate it to read events."""

    def __init__(
        self,
        stub: generation_pb2_grpc.GenerationStub,
        metadata: Sequence[tuple[str, str]],
        timeout: float | None,
    ) -> None:
        self._outgoing: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue()
        self.call = stub.GenerateStream(self._requests(), metadata=metadata, timeout=timeout)

    async def _requests(self) -> AsyncIterator[pb.GenerateStreamRequest]:
        while (message := await self._outgoing.get()) is not None:
            yield message

    async def start(self, prompt: Prompt | pb.GenerateRequest, **params: Any) -> None:
        request = (
            prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **params)
        )
        await self._outgoing.put(pb.GenerateStreamRequest(start=request))

    async def cancel(self, request_id: str) -> None:
        await self._outgoing.put(pb.GenerateStreamRequest(cancel_request_id=request_id))

    async def done_sending(self) -> None:
        """No more starts or cancels; the call ends once every request has finished."""
        await self._outgoing.put(None)

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._events()

    async def _events(self) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for event in self.call:
                yield event
        finally:
            self.call.cancel()
