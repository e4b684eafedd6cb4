"""Calls of the vLLM worker protocol (vllm.grpc.engine.VllmEngine) for tests: a Generate
collected with its metadata, and the fields a refusal names."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from service.vllm_worker.pb import vllm_engine_pb2 as vpb
from service.vllm_worker.pb import vllm_engine_pb2_grpc


@dataclass
class WorkerCall:
    """A finished Generate call: its messages and metadata."""

    chunks: list[vpb.GenerateStreamChunk] = field(default_factory=list)
    completes: list[vpb.GenerateComplete] = field(default_factory=list)
    initial: dict[str, str] = field(default_factory=dict)
    trailing: dict[str, str] = field(default_factory=dict)

    def complete(self, index: int = 0) -> vpb.GenerateComplete:
        (found,) = [c for c in self.completes if c.index == index]
        return found

    def streamed_ids(self, index: int = 0) -> list[int]:
        return [t for c in self.chunks if c.index == index for t in c.token_ids]


def engine_stub(channel: grpc.aio.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


async def generate(
    channel: grpc.aio.Channel, request: vpb.GenerateRequest, metadata: tuple = ()
) -> WorkerCall:
    call = engine_stub(channel).Generate(request, metadata=metadata, timeout=120)
    done = WorkerCall()
    async for response in call:
        match response.WhichOneof("response"):
            case "chunk":
                done.chunks.append(response.chunk)
            case "complete":
                done.completes.append(response.complete)
    done.initial = {k: v for k, v in (await call.initial_metadata() or ())}
    done.trailing = {k: v for k, v in (await call.trailing_metadata() or ())}
    return done


def violation_fields(error: grpc.aio.AioRpcError) -> list[str]:
    """The google.rpc.BadRequest fields of a failed call."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    fields: list[str] = []
    for detail in status.details if status else []:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields
