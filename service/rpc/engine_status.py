"""The gRPC status of each engine error: the one place an ErrorCode becomes a status code.

Every answer from the engine that can fail (WeightsProgress, WeightTransferJoined, SleepOutcome,
AdapterOutcome, ConstraintChecked) carries an ErrorCode (engine/protocol/error_code.py); the
Admin calls and admission answer the caller with the status mapped here, and the engine's
message. A code missing here (a member added to the enum without its status, or a test's fake
engine sending a bare name) is a bug: INTERNAL, logged.
"""

from __future__ import annotations

from types import MappingProxyType

import grpc
import structlog

from engine.protocol.error_code import ErrorCode

STATUS_OF = MappingProxyType(
    {
        ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
        ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
        ErrorCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
        ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
        ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
        ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
        ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
        ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    }
)

log = structlog.get_logger("sluice.admin")


def engine_status(code: ErrorCode | None) -> grpc.StatusCode:
    """The status a failed engine answer is reported with; INTERNAL (logged) for a code that
    has none, or for None (a failure that names no reason)."""
    status = STATUS_OF.get(code) if code is not None else None
    if status is None:
        log.error("admin.unknown_status", error_code=code)
        return grpc.StatusCode.INTERNAL
    return status
