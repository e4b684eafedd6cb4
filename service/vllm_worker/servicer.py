"""VllmEngineServicer: `vllm.grpc.engine.VllmEngine`, the worker protocol of the SMG gateway.

Generation goes through the GenerationServicer's one admission path: the request becomes a
sluice.v1 GenerateRequest (request_mapping), is admitted by `submit`, and its events become
worker-protocol responses (responses). Nothing here validates, detokenizes or matches stop
strings: those are sluice.v1's, with its semantics and limits.

The policy version has no field in this protocol: a Generate call's initial metadata carries
`sluice-policy-version` (the version the request started under), its trailing metadata
`sluice-version-spans` (JSON, per index: the versions that produced its tokens); GetModelInfo
and GetServerInfo send the served version as `sluice-policy-version` initial metadata.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import structlog
from sluice.v1 import generation_pb2 as pb

from service.config import ServiceConfig
from service.rpc.refusal import Refusal
from service.rpc.servicer import GenerationServicer
from service.vllm_worker.cache_calls import CacheCalls
from service.vllm_worker.info import loads, model_info, read_config, server_info
from service.vllm_worker.pb import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from service.vllm_worker.request_mapping import logprob_counts, renamed, to_sluice
from service.vllm_worker.responses import WorkerResponses
from service.vllm_worker.tokenizer_bundle import TokenizerBundle, chunks

log = structlog.get_logger("sluice.vllm_worker")

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
POLICY_VERSION_KEY = "sluice-policy-version"
VERSION_SPANS_KEY = "sluice-version-spans"
HEALTHY_STATES = (pb.SERVING_STATE_SERVING, pb.SERVING_STATE_UPDATING_WEIGHTS)
NOT_LOADED = "the model is not loaded yet"


class VllmEngineServicer(CacheCalls, vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, config: ServiceConfig, generation: GenerationServicer) -> None:
        self.config = config
        self.generation = generation
        self.engine = generation.engine
        self.started_at = time.monotonic()
        self.last_receive = 0.0  # time.time() of the last Generate call
        self._checkpoint: dict[str, Any] | None = None  # config.json, read once
        self._bundle: TokenizerBundle | None = None

    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        self.last_receive = time.time()
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.time() + remaining
        try:
            submitted = await self.generation.submit(to_sluice(request), deadline, context.peer())
        except Refusal as refusal:
            refusal = renamed(refusal)
            log.info("request.refused", code=refusal.code.name, message=refusal.message)
            await context.abort_with_status(refusal.to_status())
            return
        responses = WorkerResponses(
            stream=request.stream,
            counts=logprob_counts(request.sampling_params),
            prompt_token_ids=submitted.admission.request.prompt_token_ids,
            stop_token_ids=frozenset(request.sampling_params.stop_token_ids),
        )
        # NOTE: closing the events aborts the request in the engine: a client that goes away
        # (CancelledError here) cancels it, as a sluice.v1 caller's does.
        async with contextlib.aclosing(self.generation.events(submitted)) as events:
            async for event in events:
                if event.HasField("started"):
                    version = str(event.started.policy_version)
                    await context.send_initial_metadata(((POLICY_VERSION_KEY, version),))
                for response in responses.absorb(event):
                    yield response
        context.set_trailing_metadata(((VERSION_SPANS_KEY, responses.version_spans_json()),))

    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        """Each request in flight ends with finish reason "abort"; unknown ids are ignored."""
        cancelled = self.generation.cancel(list(dict.fromkeys(request.request_ids)))
        log.info("request.abort", request_ids=list(request.request_ids), cancelled=cancelled)
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        """Healthy while requests are admitted: not starting, asleep, restarting (the engine
        lost) or draining. The message names the state."""
        state = self.generation.serving_state()
        name = pb.ServingState.Name(state).removeprefix("SERVING_STATE_").lower()
        if state in HEALTHY_STATES and self.generation.tokenizer is None:
            name = "starting"  # the engine is up; its tokenizer is still loading
        healthy = state in HEALTHY_STATES and name != "starting"
        message = "serving" if healthy else f"not serving: the server is {name}"
        return vllm_engine_pb2.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        info = self.engine.info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_LOADED)
        assert info is not None
        if self._checkpoint is None:
            self._checkpoint = read_config(info.path)
        await self._send_policy_version(context)
        return model_info(info, self._checkpoint, self.config.served_model_name)

    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        await self._send_policy_version(context)
        return server_info(
            self.config,
            self.engine.info,
            self.generation.serving_state(),
            self.engine.in_flight,
            self.started_at,
            self.last_receive,
        )

    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        stats = await self.engine.refresh_stats(timeout=1.0)
        return loads(stats, self.engine.info, self.config.engine.max_num_seqs)

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        info = self.engine.info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_LOADED)
        assert info is not None
        if self._bundle is None:
            template = self.config.chat_template
            self._bundle = TokenizerBundle(
                Path(info.path), None if template is None else Path(template)
            )
        try:
            data, sha256 = await self._bundle.archive()
        except FileNotFoundError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # not reached: abort raises
        for chunk in chunks(data, sha256):
            yield chunk

    async def _send_policy_version(self, context: grpc.aio.ServicerContext) -> None:
        """The served policy version, which no field of the info responses can hold."""
        version = str(self.engine.policy_version)
        await context.send_initial_metadata(((POLICY_VERSION_KEY, version),))

    async def Embed(
        self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.EmbedResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "Embed is not served: Sluice serves generation models, not embedding models",
        )
        raise AssertionError("not reached: abort raises")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, PROFILER)
        raise AssertionError("not reached: abort raises")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, PROFILER)
        raise AssertionError("not reached: abort raises")


PROFILER = (
    "the profiler is not served: Sluice has no profiler to start over gRPC (profile the "
    "engine process with torch.profiler or py-spy)"
)
