"""AdminServicer: sluice.v1.Admin, live weight updates (and Sleep and Wake: sleep_wake.py;
LoadAdapter and UnloadAdapter: adapters.py; LoadAdapterStream: adapter_stream.py) over the
EngineClient.

UpdateWeights, in order: (auth is the interceptor's) read and validate the header
(INVALID_ARGUMENT with google.rpc.BadRequest); refuse while the engine is not serving
(UNAVAILABLE); refuse a version not above the served one (FAILED_PRECONDITION) or past the
largest uint64 (OUT_OF_RANGE), then a second update while one holds the engine client's update
slot (FAILED_PRECONDITION); for inline tensors, assemble every chunk into one temporary
file (TensorFileWriter), or for a distributed source take its tensor list (the trainer
broadcasts the bytes to the engine itself); send `UpdateWeights` to the engine and relay its
progress. The engine's
FAILED becomes the call's status, after the events already sent. The update slot and the tensor
file are released when the engine's final message arrives (or at once if the update is never
sent), not when the call ends: a caller that
walks away mid-update cannot start a second update under the first, nor delete its file.

While the engine awaits weights (it restarted, and updates received over a process group
could not be replayed), generation is refused and an update is accepted only if it replaces
every tensor, at a version above the served one (the service names it: the restarted engine
counts from its start-up version).

InitWeightTransfer holds the same update slot while the engine joins the trainer's group, so
a join and an update never overlap (service/rpc/weight_transfer.py validates its fields).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import NoReturn

import grpc
import structlog
from sluice.v1 import admin_pb2 as pb
from sluice.v1 import admin_pb2_grpc

from engine.protocol.messages import (
    MAX_POLICY_VERSION,
    TensorRef,
    UpdateWeights,
    Wake,
    WeightsPhase,
    WeightsProgress,
)
from service.config import ServiceConfig
from service.engine_link.engine_client import EngineClient
from service.engine_link.engine_process import EngineUnavailableError
from service.engine_link.engine_state import EngineState
from service.engine_link.tensor_file import NO_ROOM, ChunkError, TensorFileWriter
from service.engine_link.update_route import UpdateInProgressError
from service.ops.metrics import Metrics
from service.rpc.adapter_stream import load_adapter_stream
from service.rpc.adapters import INFLIGHT_POLICIES, load_adapter, unload_adapter
from service.rpc.arriving import arriving_within
from service.rpc.engine_status import engine_status
from service.rpc.refusal import Refusal
from service.rpc.sleep_wake import sleep_message, sleep_or_wake, sleep_response, wake_response
from service.rpc.weight_transfer import distributed_tensors, transfer_group

log = structlog.get_logger("sluice.admin")


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(
        self,
        config: ServiceConfig,
        engine: EngineClient,
        metrics: Metrics,
        draining: Callable[[], bool],
    ) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self._draining = draining

    async def InitWeightTransfer(
        self, request: pb.InitWeightTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitWeightTransferResponse:
        try:
            group = transfer_group(request, self.config)
            self._check_serving()
            try:
                self.engine.claim_update()
            except UpdateInProgressError as exc:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
            try:
                joined = await self.engine.calls.join_weight_transfer(group)
            except EngineUnavailableError as exc:
                raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
            finally:
                self.engine.release_update()
        except Refusal as refusal:
            log.info("weights.transfer_refused", code=refusal.code.name)
            await context.abort_with_status(refusal.to_status())
        if joined.error_code:
            log.warning("weights.transfer_failed", code=joined.error_code, message=joined.message)
            await context.abort(engine_status(joined.error_code), joined.message)
        where = None if group is None else f"{group.master_address}:{group.master_port}"
        log.info("weights.transfer_joined", group=where, engine_ranks=joined.engine_ranks)
        return pb.InitWeightTransferResponse(engine_ranks=joined.engine_ranks)

    async def UpdateWeights(
        self,
        request_iterator: AsyncIterator[pb.UpdateWeightsRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.UpdateWeightsProgress]:
        messages = arriving_within(request_iterator, self.config.update_idle_timeout)
        update_id = uuid.uuid4().hex
        try:
            header = _validated_header(await anext(messages, None))
            self._check_accepting(header)
            progress = await self._start(update_id, header, messages)
        except Refusal as refusal:
            log.info("weights.refused", update_id=update_id, code=refusal.code.name)
            self.metrics.weight_update_ended("refused")
            await context.abort_with_status(refusal.to_status())
            return
        except asyncio.CancelledError:
            self.metrics.weight_update_ended("abandoned")  # the caller left before sending it all
            raise
        try:
            while True:
                event = await progress.get()
                match event.phase:
                    case WeightsPhase.PAUSED:
                        yield pb.UpdateWeightsProgress(paused=pb.Paused(in_flight=event.in_flight))
                    case WeightsPhase.LOADING:
                        yield pb.UpdateWeightsProgress(loading=_loading(event))
                    case WeightsPhase.APPLIED:
                        yield pb.UpdateWeightsProgress(applied=_applied(event))
                        return
                    case WeightsPhase.FAILED:
                        await context.abort(engine_status(event.error_code), event.message)
                        return
        except asyncio.CancelledError:
            # The caller left; the engine carries on and the slot frees at its final message.
            log.info("weights.caller_gone", update_id=update_id)
            raise

    async def Sleep(
        self, request: pb.SleepRequest, context: grpc.aio.ServicerContext
    ) -> pb.SleepResponse:
        try:
            outcome = await sleep_or_wake(self.engine, sleep_message(request), self._draining())
        except Refusal as refusal:
            await context.abort_with_status(refusal.to_status())
        return sleep_response(outcome)

    async def Wake(
        self, request: pb.WakeRequest, context: grpc.aio.ServicerContext
    ) -> pb.WakeResponse:
        try:
            outcome = await sleep_or_wake(self.engine, Wake(uuid.uuid4().hex), self._draining())
        except Refusal as refusal:
            await context.abort_with_status(refusal.to_status())
        return wake_response(outcome)

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        try:
            return await load_adapter(self.engine, request, self._draining())
        except Refusal as refusal:
            await context.abort_with_status(refusal.to_status())
            raise  # not reached: abort_with_status raises

    async def LoadAdapterStream(
        self,
        request_iterator: AsyncIterator[pb.LoadAdapterStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.LoadAdapterResponse:
        messages = arriving_within(request_iterator, self.config.update_idle_timeout, "load")
        try:
            return await load_adapter_stream(self.engine, self.config, messages, self._draining())
        except Refusal as refusal:
            await context.abort_with_status(refusal.to_status())
            raise  # not reached: abort_with_status raises

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        try:
            return await unload_adapter(self.engine, request, self._draining())
        except Refusal as refusal:
            await context.abort_with_status(refusal.to_status())
            raise  # not reached: abort_with_status raises

    def _check_serving(self) -> None:
        """An admin action on the weights may start: not shutting down, an engine that is up
        (while asleep too: after a level-2 sleep an update must set every tensor), no Sleep
        or Wake in progress."""
        if self._draining():
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        up = (EngineState.SERVING, EngineState.SLEEPING, EngineState.AWAITING_WEIGHTS)
        if self.engine.state not in up:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, f"the engine is {self.engine.state.value}")
        if self.engine.sleep_link.busy:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "a Sleep or Wake is in progress")

    def _check_accepting(self, header: pb.UpdateWeightsHeader) -> None:
        self._check_serving()
        served = self.engine.policy_version
        if header.policy_version and header.policy_version <= served:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"policy_version {header.policy_version} must exceed the served version {served}",
            )
        if not header.policy_version and served >= MAX_POLICY_VERSION:
            raise Refusal(
                grpc.StatusCode.OUT_OF_RANGE,
                f"the served policy version {served} is the largest there is: no next version",
            )
        try:
            self.engine.claim_update()  # NOTE: no await since the checks above: they still hold
        except UpdateInProgressError as exc:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc

    async def _start(
        self,
        update_id: str,
        header: pb.UpdateWeightsHeader,
        messages: AsyncIterator[pb.UpdateWeightsRequest],
    ) -> asyncio.Queue[WeightsProgress]:
        """Receive the tensors (if inline) and hand the update to the engine. Owns the slot:
        releases it (and the file) itself on any failure, else when the engine finishes."""
        writer: TensorFileWriter | None = None
        try:
            update = UpdateWeights(
                update_id,
                policy_version=header.policy_version,
                inflight=INFLIGHT_POLICIES[header.inflight],
                drain_timeout=(
                    header.drain_timeout_ms / 1000 if header.HasField("drain_timeout_ms") else None
                ),
            )
            if self.engine.state is EngineState.AWAITING_WEIGHTS:
                version = header.policy_version or self.engine.policy_version + 1
                update = replace(update, policy_version=version, complete=True)
            if header.WhichOneof("source") == "checkpoint_dir":
                update = replace(update, checkpoint_dir=header.checkpoint_dir)
            elif header.WhichOneof("source") == "distributed":
                update = replace(update, distributed=distributed_tensors(header.distributed))
            else:
                writer = TensorFileWriter(self.config.weights_dir)
                refs = await _receive(writer, messages)
                update = replace(update, tensor_file=writer.path, tensors=refs)
            log.info(
                "weights.update",
                update_id=update_id,
                policy_version=update.policy_version,
                inflight=update.inflight.value,
                checkpoint_dir=update.checkpoint_dir,
                tensors=len(
                    update.tensors or (update.distributed and update.distributed.tensors) or ()
                ),
                bytes=writer.bytes_received if writer else None,
            )
            started = time.monotonic()
            return self.engine.update_weights(
                update, on_final=lambda final: self._finished(final, writer, started)
            )
        except EngineUnavailableError as exc:
            self._release(writer)
            raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        except OSError as exc:  # the tensor file: no room for it, or a bad --weights-dir
            self._release(writer)
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if exc.errno in NO_ROOM
                else grpc.StatusCode.UNAVAILABLE
            )
            raise Refusal(code, f"cannot write the tensor file in --weights-dir: {exc}") from exc
        except BaseException:
            self._release(writer)
            raise

    def _finished(
        self, final: WeightsProgress, writer: TensorFileWriter | None, started: float
    ) -> None:
        elapsed = time.monotonic() - started
        seconds = round(elapsed, 3)
        applied = final.phase is WeightsPhase.APPLIED
        self.metrics.weight_update_ended("applied" if applied else "failed", elapsed)
        if applied:
            log.info(
                "weights.applied",
                update_id=final.update_id,
                previous_version=final.previous_version,
                policy_version=final.policy_version,
                aborted=final.aborted,
                continued=final.continued,
                recomputed=final.recomputed,
                seconds=seconds,
            )
        else:
            log.warning(
                "weights.failed",
                update_id=final.update_id,
                code=final.error_code,
                message=final.message,
                seconds=seconds,
            )
        # The slot is already free (the engine client freed it when it routed `final`).
        if writer is not None and final.phase is WeightsPhase.APPLIED:
            writer.close()  # the replay log owns the file now: it is replayed after a restart
        elif writer is not None:
            writer.delete()

    def _release(self, writer: TensorFileWriter | None) -> None:
        """The update was never sent: free the slot and delete the file."""
        if writer is not None:
            writer.delete()
        self.engine.release_update()


def _validated_header(first: pb.UpdateWeightsRequest | None) -> pb.UpdateWeightsHeader:
    if first is None or first.WhichOneof("part") != "header":
        _invalid("header", "the first message must be the header")
    header = first.header
    match header.WhichOneof("source"):
        case None:
            _invalid("header.source", "set checkpoint_dir, inline_tensors or distributed")
        case "checkpoint_dir" if not header.checkpoint_dir:
            _invalid("header.checkpoint_dir", "must not be empty")
        case "inline_tensors" if not header.inline_tensors:
            _invalid("header.inline_tensors", "must be true (TensorChunk messages follow)")
        case "distributed":
            distributed_tensors(header.distributed)
    if header.inflight not in INFLIGHT_POLICIES:
        _invalid("header.inflight", f"unknown in-flight policy {header.inflight}")
    return header


async def _receive(
    writer: TensorFileWriter, messages: AsyncIterator[pb.UpdateWeightsRequest]
) -> tuple[TensorRef, ...]:
    """Every TensorChunk until the caller closes its side, written into `writer`'s file."""
    try:
        async for message in messages:
            if message.WhichOneof("part") != "tensor":
                _invalid("header", "only the first message may be a header; then TensorChunks")
            chunk = message.tensor
            await writer.add(chunk.name, chunk.dtype, list(chunk.shape), chunk.offset, chunk.data)
        return writer.finish()
    except ChunkError as exc:
        _invalid(exc.field, exc.message)


def _invalid(field_name: str, description: str) -> NoReturn:
    raise Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid update: {field_name}: {description}",
        [(field_name, description)],
    )


def _loading(event: WeightsProgress) -> pb.Loading:
    return pb.Loading(
        bytes_done=event.bytes_done,
        bytes_total=event.bytes_total,
        tensors_done=event.tensors_done,
        tensors_total=event.tensors_total,
    )


def _applied(event: WeightsProgress) -> pb.Applied:
    return pb.Applied(
        previous_version=event.previous_version,
        policy_version=event.policy_version,
        aborted=event.aborted,
        continued=event.continued,
        recomputed=event.recomputed,
        seconds=event.seconds,
    )
