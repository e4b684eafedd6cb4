"""Client: the Generation and Admin services from synchronous code (scripts, notebooks, the CLI).

UpdateWeights goes through this synchronous client on purpose: when the server ends a
client-streaming call early (a refused update), the grpc.aio client sometimes reports INTERNAL
instead of the server's status (grpc/grpc#36066); the sync client reports it faithfully.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import grpc
from sluice.v1 import admin_pb2 as admin_pb
from sluice.v1 import admin_pb2_grpc, generation_pb2_grpc
from sluice.v1 import generation_pb2 as pb

from sluice_client.adapter_stream import adapter_chunks
from sluice_client.affinity import with_affinity
from sluice_client.channels import TlsConfig, secure_or_insecure
from sluice_client.generate_stream import GenerateStream
from sluice_client.requests import (
    Collector,
    Completion,
    Prompt,
    build_request,
    chat_prompt,
    samples_asked,
)
from sluice_client.retry import Retry, channel_options
from sluice_client.weights import (
    DEFAULT_CHUNK_BYTES,
    Tensors,
    build_header,
    inflight_policy,
    tensor_chunks,
)

OnProgress = Callable[[admin_pb.UpdateWeightsProgress], None]


class Client:
    """`with Client("host:port") as client: for event in client.generate("Hello"): ...`.

    Keyword arguments of `generate`/`complete`/`generate_many` are those of `build_request`.
    `admin_token` is for the Admin calls (`update_weights`, `update_weights_inline`, `sleep`,
    `wake`, `load_adapter`, `unload_adapter`).
    `tls` (a TlsConfig) connects over TLS, with a client certificate if it names one; without
    it the channel is plaintext. Tokens are sent either way.
    `retry`: gRPC retries refused Generation calls by DEFAULT_SERVICE_CONFIG (sluice_client.retry);
    False turns that off, a mapping is a gRPC service config used instead. Neither applies to
    a `channel` passed in.
    `affinity`: a routing key (a conversation or rollout-group id) sent with every Generation
    call as `x-sluice-affinity`, for a load balancer in front of several replicas to send them
    all to one replica (sluice_client.affinity); `generate`, `complete`, `stream`,
    `generate_many` and `cancel` take their own `affinity=` too, which wins. Never sent to Admin.
    """

    def __init__(
        self,
        target: str,
        *,
        api_token: str | None = None,
        admin_token: str | None = None,
        tls: TlsConfig | None = None,
        channel: grpc.Channel | None = None,
        retry: Retry = True,
        affinity: str | None = None,
    ) -> None:
        self.channel = channel or secure_or_insecure(target, tls, channel_options(retry))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin_stub = admin_pb2_grpc.AdminStub(self.channel)
        self._api_metadata = _bearer(api_token)
        self.metadata = with_affinity(self._api_metadata, affinity)
        self.admin_metadata = _bearer(admin_token)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """The events of one request, as they arrive. Closing the iterator cancels the call."""
        request = (
            prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **params)
        )
        metadata = self._call_metadata(affinity)
        call = self.stub.Generate(request, metadata=metadata, timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the call has ended

    @overload
    def complete(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        n: Literal[1] | None = None,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> Completion: ...

    @overload
    def complete(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        n: int,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> Completion | list[Completion]: ...

    def complete(
        self,
        prompt: Prompt | pb.GenerateRequest,
        *,
        n: int | None = None,
        timeout: float | None = None,
        affinity: str | None = None,
        **params: Any,
    ) -> Completion | list[Completion]:
        """Runs one request to its end. n = 1 (the default): its Completion; n > 1 (`n=`, or
        the `n` of a GenerateRequest given): the list of its n Completions, in index order."""
        if n is not None:
            params["n"] = n
        collector = Collector()
        for event in self.generate(prompt, timeout=timeout, affinity=affinity, **params):
            collector.add(event)
        return collector.of_one_request(samples_asked(prompt, params))

    def stream(
        self, *, timeout: float | None = None, affinity: str | None = None
    ) -> GenerateStream:
        """A GenerateStream call; behind a balancer, every request it starts goes to the one
        replica the call reached (a key picks which)."""
        return GenerateStream(self.stub, self._call_metadata(affinity), timeout)

    def generate_many(
        self,
        prompts: Iterable[Prompt | pb.GenerateRequest],
        *,
        affinity: str | None = None,
        **params: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Every prompt over one GenerateStream; events of all requests, interleaved."""
        stream = self.stream(affinity=affinity)
        for prompt in prompts:
            stream.start(prompt, **params)
        stream.done_sending()
        yield from stream

    def cancel(
        self, request_ids: Iterable[str], *, affinity: str | None = None
    ) -> pb.CancelResponse:
        """Behind a balancer, a Cancel reaches the replica running the requests only with the
        affinity key they were sent with (the others answer `not_found`)."""
        return self.stub.Cancel(
            pb.CancelRequest(request_ids=list(request_ids)),
            metadata=self._call_metadata(affinity),
        )

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, metadata=self.metadata).token_ids)

    def render_chat(
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
        return self.stub.RenderChat(request, metadata=self.metadata, timeout=timeout)

    def info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self.metadata)

    def _call_metadata(self, affinity: str | None) -> tuple[tuple[str, str], ...]:
        """The metadata of a Generation call: a call's own key wins over the client's."""
        if affinity is None:
            return tuple(self.metadata)
        return with_affinity(self._api_metadata, affinity)

    # ---- Admin ----

    def update_weights(
        self,
        checkpoint_dir: str,
        *,
        policy_version: int = 0,
        inflight: str = "drain",
        drain_timeout_ms: int | None = None,
        on_progress: OnProgress | None = None,
        timeout: float | None = None,
    ) -> admin_pb.Applied:
        """Swap in the weights of an HF checkpoint directory on the server's file system.

        `inflight`: drain | abort | continue | recompute; `policy_version` 0 = served + 1.
        `on_progress` sees every event (paused, loading, applied). Returns the Applied event;
        a refused or failed update raises grpc.RpcError with the server's status code.
        """
        header = build_header(
            checkpoint_dir=checkpoint_dir,
            policy_version=policy_version,
            inflight=inflight,
            drain_timeout_ms=drain_timeout_ms,
        )
        return self._update(
            iter([admin_pb.UpdateWeightsRequest(header=header)]), on_progress, timeout
        )

    def update_weights_inline(
        self,
        tensors: Tensors,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        policy_version: int = 0,
        inflight: str = "drain",
        drain_timeout_ms: int | None = None,
        on_progress: OnProgress | None = None,
        timeout: float | None = None,
    ) -> admin_pb.Applied:
        """Send some of the model's tensors, `{name: (dtype, shape, raw bytes)}` (dtype "F32",
        "F16" or "BF16", equal to the served dtype; row-major little-endian bytes), each split
        into chunks of at most `chunk_bytes`. The other tensors keep their values."""
        header = build_header(
            inline_tensors=True,
            policy_version=policy_version,
            inflight=inflight,
            drain_timeout_ms=drain_timeout_ms,
        )
        requests = itertools.chain(
            [admin_pb.UpdateWeightsRequest(header=header)], tensor_chunks(tensors, chunk_bytes)
        )
        return self._update(requests, on_progress, timeout)

    def sleep(
        self,
        level: int = 1,
        *,
        inflight: str = "drain",
        drain_timeout_ms: int | None = None,
        timeout: float | None = None,
    ) -> admin_pb.SleepResponse:
        """Free the server's KV cache and prefix cache (level 1), and its weights too (level
        2), until `wake()`; generation is refused UNAVAILABLE meanwhile. `inflight`: drain
        (admitted requests finish first) | abort (they end ABORTED). A refusal or failure
        raises grpc.RpcError with the server's status code."""
        request = admin_pb.SleepRequest(level=level, inflight=inflight_policy(inflight))
        if drain_timeout_ms is not None:
            request.drain_timeout_ms = drain_timeout_ms
        response: admin_pb.SleepResponse = self.admin_stub.Sleep(
            request, metadata=self.admin_metadata, timeout=timeout
        )
        return response

    def wake(self, *, timeout: float | None = None) -> admin_pb.WakeResponse:
        """Serve again after `sleep()` (after level 2 the server reads its weights again)."""
        response: admin_pb.WakeResponse = self.admin_stub.Wake(
            admin_pb.WakeRequest(), metadata=self.admin_metadata, timeout=timeout
        )
        return response

    def load_adapter(
        self,
        name: str,
        path: str,
        *,
        pinned: bool = False,
        replace: bool = False,
        policy_version: int = 0,
        inflight: str = "drain",
        timeout: float | None = None,
    ) -> pb.AdapterInfo:
        """Admin LoadAdapter: load the PEFT adapter directory `path` (on the server's disk) as
        `name` at `policy_version` (0: 1); requests select it with `adapter=name`. `replace`:
        update the loaded `name` in place (policy_version 0 = its version + 1; `inflight`:
        drain | abort | continue | recompute, what its running requests do). The loaded
        adapter's AdapterInfo."""
        request = admin_pb.LoadAdapterRequest(
            name=name,
            path=path,
            pinned=pinned,
            replace=replace,
            policy_version=policy_version,
            inflight=inflight_policy(inflight),
        )
        response: admin_pb.LoadAdapterResponse = self.admin_stub.LoadAdapter(
            request,
            metadata=self.admin_metadata,
            timeout=timeout,
        )
        return response.adapter

    def load_adapter_tensors(
        self,
        name: str,
        config: Mapping[str, Any] | str,
        tensors: Mapping[str, Any] | str | Path,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> pb.AdapterInfo:
        """Admin LoadAdapterStream: load_adapter with the adapter's config and tensors sent, not
        read from the server's disk (sluice_client.adapter_stream.adapter_chunks: `options`)."""
        chunks, metadata = adapter_chunks(name, config, tensors, **options), self.admin_metadata
        response = self.admin_stub.LoadAdapterStream(chunks, metadata=metadata, timeout=timeout)
        return response.adapter

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Admin UnloadAdapter: forget the adapter `name` (NOT_FOUND if it is not loaded,
        FAILED_PRECONDITION while requests run it)."""
        self.admin_stub.UnloadAdapter(
            admin_pb.UnloadAdapterRequest(name=name), metadata=self.admin_metadata, timeout=timeout
        )

    def adapters(self) -> list[pb.AdapterInfo]:
        """The loaded LoRA adapters (ServerInfo.adapters): no admin token needed."""
        return list(self.info().adapters)

    def init_weight_transfer(
        self, request: admin_pb.InitWeightTransferRequest, *, timeout: float | None = None
    ) -> admin_pb.InitWeightTransferResponse:
        """Join the server's engine to a trainer's process group (or, with `close`, leave it).
        It returns once every rank has joined: the trainer joins meanwhile (the helper
        sluice_client.weight_transfer does both)."""
        response: admin_pb.InitWeightTransferResponse = self.admin_stub.InitWeightTransfer(
            request, metadata=self.admin_metadata, timeout=timeout
        )
        return response

    def _update(
        self,
        requests: Iterator[admin_pb.UpdateWeightsRequest],
        on_progress: OnProgress | None,
        timeout: float | None,
    ) -> admin_pb.Applied:
        call = self.admin_stub.UpdateWeights(
            requests, metadata=self.admin_metadata, timeout=timeout
        )
        applied = None
        # NOTE: read to the call's end, not just to `applied`: an iterator dropped early cancels
        # the call, and the server would log and count a successful update as cancelled.
        for event in call:
            if on_progress is not None:
                on_progress(event)
            if event.HasField("applied"):
                applied = event.applied
        if applied is None:
            raise RuntimeError("UpdateWeights ended without an applied event")
        return applied


def _bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("authorization", f"Bearer {token}"),)
