"""GenerationServicer: the six RPCs of sluice.v1.Generation over the EngineClient.

Protobuf stops here: requests are translated to engine messages by `admission`, engine outputs
to events by `Completion`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
from sluice.v1 import generation_pb2 as pb
from sluice.v1 import generation_pb2_grpc

from engine.protocol.messages import AddRequest, FinishReason, RequestOutput
from service.config import MAX_SEND_MESSAGE_BYTES, ServiceConfig
from service.engine_link.engine_client import EngineClient
from service.engine_link.engine_process import EngineUnavailableError
from service.engine_link.engine_state import EngineState
from service.engine_link.routing import Inbox
from service.ops.metrics import Metrics
from service.rpc.adapters import adapter_info
from service.rpc.admission import Admission, admit, text_violations
from service.rpc.chat import render
from service.rpc.generate_stream import Admitted, GenerateStreamCall, StreamLimits
from service.rpc.refusal import Refusal, invalid_argument
from service.rpc.structured import check_constraint
from service.text.chat_template import ChatTemplate
from service.text.completion import Completion
from service.text.tokenizer import Tokenizer

log = structlog.get_logger("sluice.servicer")

SERVING_STATES = {
    EngineState.STARTING: pb.SERVING_STATE_STARTING,
    EngineState.SERVING: pb.SERVING_STATE_SERVING,
    EngineState.SLEEPING: pb.SERVING_STATE_SLEEPING,
    EngineState.RESTARTING: pb.SERVING_STATE_RESTARTING,
    EngineState.AWAITING_WEIGHTS: pb.SERVING_STATE_RESTARTING,  # recovering: not serving yet
    EngineState.STOPPING: pb.SERVING_STATE_DRAINING,
    EngineState.STOPPED: pb.SERVING_STATE_DRAINING,
}


@dataclass(frozen=True)
class Submitted:
    """An admitted request in the engine: `GenerationServicer.events` turns it into events."""

    admission: Admission
    inbox: Inbox
    deadline: float | None


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, config: ServiceConfig, engine: EngineClient, metrics: Metrics) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.tokenizer: Tokenizer | None = None  # set once the engine is first Ready
        self.chat_template: ChatTemplate | None = None  # set with the tokenizer, if any
        self.draining = False  # SIGTERM: refuse new requests, let in-flight ones finish

    # ---- RPCs ----

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        # NOTE: grpc.aio runs each call in a task of its own, so this binding is this call's
        # alone; submit rebinds it to the id the server assigns when the caller gave none.
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        deadline = _deadline(context)
        try:
            submitted = await self.submit(request, deadline, context.peer())
        except Refusal as refusal:
            log.info("request.refused", code=refusal.code.name, message=refusal.message)
            await context.abort_with_status(refusal.to_status())
            return
        async for event in self.events(submitted):
            yield event

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[pb.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Many requests over one stream (GenerateStreamCall). A refused `start` yields one
        `refused` event instead of ending the stream. A request stream that fails (a message
        that does not parse) ends the call with its status, after the `finished` of every
        admitted request."""
        deadline = _deadline(context)

        async def start(request: pb.GenerateRequest) -> Admitted:
            submitted = await self.submit(request, deadline, context.peer())
            submitted.inbox.meter = call.meter  # no await since submit: nothing arrived yet
            added = submitted.admission.request
            events = self.events(submitted)
            return Admitted(added.request_id, added.n, len(added.prompt_token_ids), events)

        limits = StreamLimits(
            max_requests=self.config.max_stream_requests,
            max_buffer_bytes=self.config.max_stream_buffer_bytes,
            idle_timeout=self.config.stream_idle_timeout,
        )
        call = GenerateStreamCall(start, self.cancel, limits)
        async for event in call.run(request_iterator):
            yield event
        if call.failure is not None:
            await context.abort_with_status(call.failure.to_status())

    async def Cancel(
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelResponse:
        ids = list(dict.fromkeys(request.request_ids))
        cancelled = self.cancel(ids)
        not_found = [rid for rid in ids if rid not in cancelled]
        return pb.CancelResponse(cancelled=cancelled, not_found=not_found)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        if self.tokenizer is None or self.engine.info is None:
            unavailable = self._unavailable("the model is not loaded yet")
            await context.abort_with_status(unavailable.to_status())
        assert self.tokenizer is not None and self.engine.info is not None
        # A text that could not be a prompt is not encoded either (the work grows with it).
        violations = text_violations(request.text, self.engine.info, self.tokenizer)
        if violations:
            await context.abort_with_status(invalid_argument(violations).to_status())
        ids = await self.tokenizer.encode(request.text, request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids)

    async def RenderChat(
        self, request: pb.RenderChatRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenderChatResponse:
        if self.tokenizer is None or self.engine.info is None:
            unavailable = self._unavailable("the model is not loaded yet")
            await context.abort_with_status(unavailable.to_status())
        assert self.tokenizer is not None and self.engine.info is not None
        try:
            text, ids = await render(
                request.chat,
                self.chat_template,
                self.engine.info,
                self.tokenizer,
                self.config.max_chat_messages,
            )
        except Refusal as refusal:
            await context.abort_with_status(refusal.to_status())
            raise  # not reached: abort_with_status raises
        return pb.RenderChatResponse(text=text, token_ids=ids)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        stats = await self.engine.refresh_stats(timeout=1.0)
        adapters = (
            await self.engine.adapters.refresh(timeout=1.0) if self.config.engine.max_loras else ()
        )
        info = self.engine.info
        state = self.serving_state()
        name = self.config.served_model_name
        ranks = self.config.engine.tensor_parallel_size
        method, proposal = _speculation(self.config)
        if info is None:
            model = name or self.config.engine.model
            return pb.ServerInfo(
                model=model,
                state=state,
                tensor_parallel_size=ranks,
                speculative_method=method,
                num_speculative_tokens=proposal,
            )
        return pb.ServerInfo(
            model=name or info.model,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            policy_version=self.engine.policy_version,
            eos_token_ids=info.eos_token_ids,
            device=info.device,
            dtype=info.dtype,
            state=state,
            kv_cache=pb.KvCacheInfo(
                page_size=info.page_size,
                total_pages=stats.total_pages or info.total_pages,
                free_pages=stats.free_pages,
                cached_pages=stats.cached_pages,
                prefix_cache_hit_ratio=stats.prefix_hit_ratio,
            ),
            running=stats.running,
            waiting=stats.waiting,
            adapters=[adapter_info(state) for state in adapters],
            moe_layers=info.moe_layers,
            experts_per_token=info.moe_top_k,
            tensor_parallel_size=ranks,
            speculative_method=method,
            num_speculative_tokens=proposal,
        )

    def serving_state(self) -> pb.ServingState.ValueType:
        """The state GetServerInfo reports. Only reads attributes: the metrics thread calls it."""
        state = pb.SERVING_STATE_DRAINING if self.draining else SERVING_STATES[self.engine.state]
        if state == pb.SERVING_STATE_SERVING and self.engine.updating_weights:
            state = pb.SERVING_STATE_UPDATING_WEIGHTS
        return state

    # ---- admission and streaming ----

    async def submit(
        self, req: pb.GenerateRequest, deadline: float | None, caller: str
    ) -> Submitted:
        """Admit a request and hand it to the engine, or raise Refusal. `caller`: the gRPC
        peer (its connection), whose constraint compiles are shared out fairly.

        The one admission path: the OpenAI front and the vLLM worker protocol translate their
        requests to a sluice.v1 GenerateRequest and come here too, then read `events`."""
        self._check_available()
        assert self.tokenizer is not None and self.engine.info is not None
        admission = await admit(
            req,
            info=self.engine.info,
            tokenizer=self.tokenizer,
            policy_version=self.engine.policy_version,
            deadline=deadline,
            retry_after=self.config.retry_after,
            max_message_bytes=MAX_SEND_MESSAGE_BYTES,
            chat_template=self.chat_template,
            max_chat_messages=self.config.max_chat_messages,
            adapters=self.engine.adapters.versions,
        )
        if (structured := admission.request.params.structured) is not None:
            await check_constraint(self.engine, structured, caller)  # compiled, or refused
        # NOTE: no await from here to submit(): the duplicate and queue checks stay true.
        self._check_available()
        request_id = admission.request.request_id
        structlog.contextvars.bind_contextvars(request_id=request_id)  # maybe just assigned
        if self.engine.has(request_id):
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is in flight")
        if self.engine.waiting >= self.config.max_waiting:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the waiting queue is full ({self.config.max_waiting} requests)",
                retry_after=self.config.retry_after,
            )
        try:
            inbox = self.engine.submit(admission.request)
        except EngineUnavailableError as exc:
            raise self._unavailable(str(exc)) from exc
        if adapter := admission.request.params.adapter:
            self.metrics.adapter_request(adapter)
        return Submitted(admission, inbox, deadline)

    def _check_available(self) -> None:
        if self.draining:
            raise self._unavailable("the server is shutting down")
        if self.engine.state is EngineState.AWAITING_WEIGHTS:
            raise self._unavailable(
                f"the engine restarted and lost policy version {self.engine.policy_version}: "
                "weights received over a process group cannot be replayed, and older ones are "
                "not served under it; generation resumes after a weight update that replaces "
                "every tensor"
            )
        if self.engine.state is not EngineState.SERVING or self.tokenizer is None:
            raise self._unavailable(f"the engine is {self.engine.state.value}")

    def _unavailable(self, message: str) -> Refusal:
        """UNAVAILABLE says: retry, here once the engine serves again, or on another replica
        (a draining server's). It carries the same retry delay as an overload refusal."""
        return Refusal(grpc.StatusCode.UNAVAILABLE, message, retry_after=self.config.retry_after)

    async def events(self, submitted: Submitted) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Events of one admitted request: `started`, chunks, one `finished` per index, last.

        Each wake-up sends every output waiting in the queue as one chunk (coalescing): the
        caller resumes it only once its previous event is written.
        """
        assert self.tokenizer is not None
        request = submitted.admission.request
        rid = request.request_id
        completions = {
            i: Completion(rid, i, self.tokenizer, submitted.admission.output)
            for i in range(request.n)
        }
        started_at = time.monotonic()
        started = False
        abandoned: FinishReason | None = None
        try:
            inbox, unfinished = submitted.inbox, request.n
            while unfinished:
                # NOTE: the only coalescing point. While this generator's previous event is
                # being written, grpc.aio does not resume it, so whatever the engine produced
                # meanwhile is waiting here and goes out as one chunk; an idle stream finds
                # one output and sends it at once.
                outputs = await inbox.take()
                if not started:
                    started = True
                    yield _started_event(rid, outputs)
                for index, completion in completions.items():
                    mine = outputs if request.n == 1 else [o for o in outputs if o.index == index]
                    if mine and not completion.finished:
                        events = completion.absorb(mine)
                        unfinished -= completion.finished
                        if completion.finish_reason is not None:
                            self.metrics.completion_finished(completion.finish_reason.value)
                        for event in events:
                            yield event
                        if completion.finished_early:
                            # A stop string matched: the engine is still generating this
                            # sample; stop it (its final output is ignored).
                            self.engine.abort([rid], FinishReason.CANCELLED, index)
        except BaseException:
            # Client disconnect, deadline, or the stream's end (asyncio.CancelledError in
            # grpc.aio, not context.cancelled()): abort in the engine, then re-raise. Unless
            # every sample had finished: a caller may leave as soon as it has the last event.
            if not all(c.finished for c in completions.values()):
                expired = request.deadline is not None and time.time() >= request.deadline
                abandoned = FinishReason.DEADLINE_EXCEEDED if expired else FinishReason.CANCELLED
                self.engine.abort([rid], abandoned)
                for completion in completions.values():
                    if not completion.finished:
                        self.metrics.completion_finished(abandoned.value)
            raise
        finally:
            self.engine.detach(rid)
            submitted.inbox.release()  # what it still holds no longer counts against a stream
            self._ended(request, list(completions.values()), abandoned, started_at)

    def _ended(
        self,
        request: AddRequest,
        completions: list[Completion],
        abandoned: FinishReason | None,
        started_at: float,
    ) -> None:
        """Count an ended request's adapter tokens and log how it ended."""
        rid = request.request_id
        # NOTE: request_id passed explicitly: a generator closed by the garbage collector
        # runs this in whatever context is current then.
        if adapter := request.params.adapter:
            tokens = sum(c.completion_tokens for c in completions)
            self.metrics.adapter_tokens(adapter, tokens)
        if abandoned is not None:
            log.info("request.abandoned", request_id=rid, reason=abandoned.value)
        else:
            log.info(
                "request.finished",
                request_id=rid,
                finish_reasons=[c.finish_reason for c in completions],
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=sum(c.completion_tokens for c in completions),
                seconds=round(time.monotonic() - started_at, 4),
            )

    def cancel(self, request_ids: list[str]) -> list[str]:
        found = [rid for rid in request_ids if self.engine.has(rid)]
        self.engine.abort(found, FinishReason.CANCELLED)
        return found


def _speculation(config: ServiceConfig) -> tuple[str, int]:
    """ServerInfo's speculative_method and num_speculative_tokens (0 when it is "off")."""
    method = config.engine.speculative_method
    return method, config.engine.num_speculative_tokens if method != "off" else 0


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.time() + remaining


def _started_event(request_id: str, outputs: list[RequestOutput]) -> pb.GenerateResponse:
    """The `started` event, from a request's first outputs (index 0's carries the prompt
    logprobs when asked for)."""
    first = outputs[0]
    started = pb.Started(
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        policy_version=first.policy_version,
    )
    scores = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    if scores is not None:
        started.prompt_logprobs.start = scores.start
        started.prompt_logprobs.logprobs.extend(scores.logprobs)
        for routed in scores.routed_experts or []:
            started.prompt_logprobs.routed_experts.extend(routed)
        for ids, logprobs in scores.top_logprobs or []:
            started.prompt_logprobs.top_logprobs.add(token_ids=ids, logprobs=logprobs)
    return pb.GenerateResponse(request_id=request_id, started=started)
