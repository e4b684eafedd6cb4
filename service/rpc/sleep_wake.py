"""Admin Sleep and Wake: validation, refusals and the engine's answer as a response or status.

Checked in order: the request's fields (INVALID_ARGUMENT with google.rpc.BadRequest naming
`level` or `inflight`); the server shutting down or the engine not up (UNAVAILABLE); another
Admin action in progress (FAILED_PRECONDITION); for a Wake from level 2, a checkpoint directory
the served weights would be read from that changed since it was applied (FAILED_PRECONDITION,
as a restart refuses it). Then the EngineClient sends it and waits; the engine's refusal or
failure (error_code) becomes the call's status.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import NoReturn

import grpc
import structlog
from sluice.v1 import admin_pb2 as pb

from engine.protocol.messages import InflightPolicy, Sleep, SleepOutcome, Wake
from service.engine_link.engine_client import EngineClient
from service.engine_link.engine_process import EngineUnavailableError
from service.engine_link.engine_state import EngineState
from service.rpc.engine_status import engine_status
from service.rpc.refusal import Refusal

log = structlog.get_logger("sluice.admin")

SLEEP_POLICIES = {
    pb.INFLIGHT_POLICY_UNSPECIFIED: InflightPolicy.DRAIN,
    pb.INFLIGHT_POLICY_DRAIN: InflightPolicy.DRAIN,
    pb.INFLIGHT_POLICY_ABORT: InflightPolicy.ABORT,
}


def sleep_message(request: pb.SleepRequest) -> Sleep:
    """The engine's Sleep for a valid request; Refusal INVALID_ARGUMENT otherwise."""
    level = request.level or 1
    if level not in (1, 2):
        _invalid("level", f"must be 1 (KV cache) or 2 (KV cache and weights), not {level}")
    inflight = SLEEP_POLICIES.get(request.inflight)
    if inflight is None:
        name = pb.InflightPolicy.Name(request.inflight) if request.inflight in (3, 4) else None
        _invalid("inflight", f"{name or request.inflight} is not DRAIN or ABORT")
    timeout = request.drain_timeout_ms / 1000 if request.HasField("drain_timeout_ms") else None
    return Sleep(uuid.uuid4().hex, level, inflight, timeout)


async def sleep_or_wake(engine: EngineClient, msg: Sleep | Wake, draining: bool) -> SleepOutcome:
    """Send `msg` after the server-side checks; the engine's answer, or Refusal."""
    if draining:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
    if engine.state not in (EngineState.SERVING, EngineState.SLEEPING):
        raise Refusal(grpc.StatusCode.UNAVAILABLE, f"the engine is {engine.state.value}")
    if engine.updating_weights or engine.sleep_link.busy:
        why = "another Admin action (UpdateWeights, Sleep or Wake) is in progress"
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, why)
    if isinstance(msg, Wake) and engine.sleep_link.level == 2:
        changed = await asyncio.to_thread(engine.replay_log.changed)
        if changed is not None:
            why = (
                f"checkpoint_dir {changed.checkpoint_dir!r} changed since policy version "
                f"{changed.policy_version} was applied from it: the served weights cannot be "
                "read again (apply an UpdateWeights with every tensor, then Wake)"
            )
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, why)
    kind = "sleep" if isinstance(msg, Sleep) else "wake"
    log.info(f"{kind}.start", sleep_id=msg.sleep_id, level=getattr(msg, "level", None))
    try:
        outcome = await engine.sleep_or_wake(msg)
    except EngineUnavailableError as exc:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
    if not outcome.ok:
        log.warning(f"{kind}.failed", code=outcome.error_code, message=outcome.message)
        raise Refusal(engine_status(outcome.error_code), outcome.message)
    log.info(f"{kind}.done", level=outcome.level, seconds=round(outcome.seconds, 3))
    return outcome


def sleep_response(outcome: SleepOutcome) -> pb.SleepResponse:
    return pb.SleepResponse(
        level=outcome.level,
        aborted=outcome.aborted,
        released_bytes=outcome.released_bytes,
        seconds=outcome.seconds,
    )


def wake_response(outcome: SleepOutcome) -> pb.WakeResponse:
    return pb.WakeResponse(
        reloaded=outcome.reloaded, policy_version=outcome.policy_version, seconds=outcome.seconds
    )


def _invalid(field_name: str, description: str) -> NoReturn:
    raise Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid sleep: {field_name}: {description}",
        [(field_name, description)],
    )
