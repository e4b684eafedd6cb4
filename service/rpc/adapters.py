"""Admin LoadAdapter and UnloadAdapter: validation, refusals, and the engine's answer as a
response or a status; AdapterInfo for GetServerInfo and LoadAdapterResponse.

Checked in order: the request's fields (INVALID_ARGUMENT with google.rpc.BadRequest naming
`name` or `path`; `header.request.*` for LoadAdapterStream, service/rpc/adapter_stream.py); the server shutting down or the engine not up (UNAVAILABLE); the server
asleep (FAILED_PRECONDITION). Then the EngineClient's AdapterLink sends it and waits; the engine
names the status of a failure (engine/process.py `adapter_outcome`): INVALID_ARGUMENT (the
adapter does not fit: named `path`), ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION (max_loras
is 0, pinning every slot, requests running it, a replace's version not newer), OUT_OF_RANGE.
A `replace` updates the adapter in place (engine/lora/adapter_update.py), `inflight` mapped as
UpdateWeights maps it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import NoReturn

import grpc
import structlog
from sluice.v1 import admin_pb2 as pb
from sluice.v1 import generation_pb2 as gen_pb

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import AdapterOutcome, AdapterState, InflightPolicy, LoadAdapter
from service.config import MAX_REQUEST_ID_LENGTH
from service.engine_link.engine_client import EngineClient
from service.engine_link.engine_process import EngineUnavailableError
from service.engine_link.engine_state import EngineState
from service.rpc.engine_status import engine_status
from service.rpc.refusal import Refusal

log = structlog.get_logger("sluice.admin")

MAX_ADAPTER_NAME_LENGTH = MAX_REQUEST_ID_LENGTH  # 256: a name travels on every request

# The in-flight policies of UpdateWeights (admin.py) and of a LoadAdapter with `replace`.
INFLIGHT_POLICIES = {
    pb.INFLIGHT_POLICY_UNSPECIFIED: InflightPolicy.DRAIN,
    pb.INFLIGHT_POLICY_DRAIN: InflightPolicy.DRAIN,
    pb.INFLIGHT_POLICY_ABORT: InflightPolicy.ABORT,
    pb.INFLIGHT_POLICY_CONTINUE: InflightPolicy.CONTINUE,
    pb.INFLIGHT_POLICY_RECOMPUTE: InflightPolicy.RECOMPUTE,
}


async def load_adapter(
    engine: EngineClient, request: pb.LoadAdapterRequest, draining: bool
) -> pb.LoadAdapterResponse:
    """Load the adapter; its AdapterInfo, or Refusal."""
    check_load(engine, request, draining, path_field="path")
    return await send_load(engine, request, request.path)


def check_load(
    engine: EngineClient, request: pb.LoadAdapterRequest, draining: bool, path_field: str
) -> None:
    """Refusal unless the request's fields are valid (BadRequest names them with the prefix of
    `path_field`: "path" or "header.request.path") and the engine can load an adapter now.
    An empty `path` is refused for a directory load; a non-empty one for a streamed one."""
    prefix = path_field.removesuffix("path")
    _check_name(request.name, prefix)
    if prefix and request.path:
        _invalid(path_field, "must be empty: the server spools a streamed adapter itself")
    if not prefix and not request.path:
        _invalid(path_field, "must not be empty")
    _check_up(engine, draining)
    if request.inflight not in INFLIGHT_POLICIES:
        _invalid(f"{prefix}inflight", f"unknown in-flight policy {request.inflight}")


async def send_load(
    engine: EngineClient,
    request: pb.LoadAdapterRequest,
    path: str,
    content_field: Callable[[str], str] = lambda _: "path",
) -> pb.LoadAdapterResponse:
    """Have the engine load (or replace) the adapter at `path`; its AdapterInfo, or Refusal
    (`content_field` names the field an INVALID_ARGUMENT of the engine's message blames). A
    path that is not `request.path` is a spool the engine client owns from here on."""
    inflight = INFLIGHT_POLICIES[request.inflight]
    log.info(
        "adapter.load",
        adapter=request.name,
        path=path,
        pinned=request.pinned,
        replace=request.replace,
        policy_version=request.policy_version,
        inflight=inflight.value,
    )
    msg = LoadAdapter(
        uuid.uuid4().hex,
        request.name,
        path,
        request.pinned,
        request.replace,
        request.policy_version,
        inflight,
    )
    try:
        outcome = await engine.adapters.load(msg, owned=path != request.path)
    except EngineUnavailableError as exc:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
    _raise_failure(outcome, "load", content_field)
    state = next(s for s in outcome.adapters if s.name == request.name)
    log.info(
        "adapter.loaded",
        adapter=state.name,
        rank=state.rank,
        resident=state.resident,
        policy_version=state.policy_version,
    )
    return pb.LoadAdapterResponse(adapter=adapter_info(state))


async def unload_adapter(
    engine: EngineClient, request: pb.UnloadAdapterRequest, draining: bool
) -> pb.UnloadAdapterResponse:
    """Forget the adapter, or Refusal."""
    _check_name(request.name)
    _check_up(engine, draining)
    try:
        outcome = await engine.adapters.unload(request.name)
    except EngineUnavailableError as exc:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
    _raise_failure(outcome, "unload")
    log.info("adapter.unloaded", adapter=request.name)
    return pb.UnloadAdapterResponse()


def adapter_info(state: AdapterState) -> gen_pb.AdapterInfo:
    return gen_pb.AdapterInfo(
        name=state.name,
        path=state.path,
        rank=state.rank,
        target_modules=state.target_modules,
        pinned=state.pinned,
        resident=state.resident,
        scaling=state.scaling,
        policy_version=state.policy_version,
    )


def _check_name(name: str, prefix: str = "") -> None:
    if not name:
        _invalid(f"{prefix}name", "must not be empty (the empty adapter is the base model)")
    if len(name) > MAX_ADAPTER_NAME_LENGTH:
        _invalid(f"{prefix}name", f"must be at most {MAX_ADAPTER_NAME_LENGTH} characters")


def _check_up(engine: EngineClient, draining: bool) -> None:
    if draining:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
    if engine.state is EngineState.SLEEPING:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the server sleeps: Wake it first")
    if engine.state is not EngineState.SERVING:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, f"the engine is {engine.state.value}")


def _raise_failure(
    outcome: AdapterOutcome, action: str, content_field: Callable[[str], str] = lambda _: "path"
) -> None:
    if outcome.ok:
        return
    log.warning(f"adapter.{action}_failed", code=outcome.error_code, message=outcome.message)
    if (
        outcome.error_code is ErrorCode.INVALID_ARGUMENT
    ):  # the adapter's content: `path`, or streamed
        _invalid(content_field(outcome.message), outcome.message)
    raise Refusal(engine_status(outcome.error_code), outcome.message)


def _invalid(field_name: str, description: str) -> NoReturn:
    raise Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid adapter: {field_name}: {description}",
        [(field_name, description)],
    )
