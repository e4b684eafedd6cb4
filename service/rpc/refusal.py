"""Refusal: a request refused before admission, as a gRPC status with its details.

Each refusal carries one deliberate status code (the table in docs/service.md); INVALID_ARGUMENT
names the fields (google.rpc.BadRequest), RESOURCE_EXHAUSTED and UNAVAILABLE carry a retry delay
(google.rpc.RetryInfo and the grpc-retry-pushback-ms trailer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

# gRPC's standard trailer: a client's retry policy waits this many milliseconds before its next
# attempt (instead of its own backoff). gRPC clients honour it for these codes only.
PUSHBACK_KEY = "grpc-retry-pushback-ms"
PUSHBACK_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})
# The delay a refusal suggests is retry_after times a random factor in [1, RETRY_JITTER): calls
# refused in the same instant, all told the same delay, would all come back in the same instant.
RETRY_JITTER = 1.5


class Refusal(Exception):
    """A request refused before admission: a non-OK status and no events.

    `retry_after` (seconds): retrying later may succeed. The caller is told `retry_delay_ms`,
    retry_after with jitter (see RETRY_JITTER), drawn once: RetryInfo, the pushback trailer and
    a GenerateStream `Refused` event of this refusal all carry the same value.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        violations: list[tuple[str, str]] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = violations or []
        self.retry_delay_ms = (
            None
            if retry_after is None
            else round(retry_after * random.uniform(1.0, RETRY_JITTER) * 1000)
        )

    def to_status(self) -> grpc.Status:
        details = []
        if self.violations:
            bad_request = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                    for f, d in self.violations
                ]
            )
            details.append(_pack(bad_request))
        if self.retry_delay_ms is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(self.retry_delay_ms)
            details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
        status = status_pb2.Status(
            code=getattr(code_pb2, self.code.name), message=self.message, details=details
        )
        trailers = rpc_status.to_status(status).trailing_metadata
        if self.retry_delay_ms is not None and self.code in PUSHBACK_CODES:
            trailers = (*trailers, (PUSHBACK_KEY, str(self.retry_delay_ms)))
        return _Status(self.code, self.message, trailers)


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def _pack(message: error_details_pb2.BadRequest | error_details_pb2.RetryInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def invalid_argument(violations: list[tuple[str, str]]) -> Refusal:
    """The refusal of a request with these (field, description) violations."""
    description = "; ".join(f"{f}: {d}" for f, d in violations)
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {description}", violations)
