"""Each engine ErrorCode maps to one gRPC status, in service/rpc/engine_status.py."""

from __future__ import annotations

import pickle

import grpc
import pytest

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import SleepOutcome, WeightsPhase, WeightsProgress
from service.rpc.engine_status import engine_status


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_code_maps_to_the_grpc_status_of_its_name(code: ErrorCode) -> None:
    assert engine_status(code) is grpc.StatusCode[code.name]


@pytest.mark.parametrize("code", [None, "NOT_A_CODE", "OK"])
def test_a_code_without_a_status_is_internal(code: ErrorCode | None) -> None:
    assert engine_status(code) is grpc.StatusCode.INTERNAL


def test_an_answer_carries_its_code_across_the_pipe_as_the_enum() -> None:
    failed = WeightsProgress("u", WeightsPhase.FAILED, error_code=ErrorCode.ABORTED)
    assert pickle.loads(pickle.dumps(failed)).error_code is ErrorCode.ABORTED
    assert SleepOutcome("s", 0).ok and not SleepOutcome("s", 0, ErrorCode.ABORTED).ok
