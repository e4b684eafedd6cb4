"""Calls the adapter tests make through gRPC (tests/service/rpc/test_adapters_service.py,
test_adapter_stream_service.py): Admin calls with the token, a refusal's code and BadRequest
fields, a greedy completion with logprobs, the listed adapters, the comparison with peft."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import admin_pb2_grpc
from sluice_client import Client

ADMIN_TOKEN = "adm1n-s3cret"
PROMPT = [0, 17, 42, 99, 123, 7, 88, 5]
NEW_TOKENS = 12


def complete(target: str, adapter: str) -> tuple[list[int], list[float]]:
    with Client(target, retry=False) as client:
        done = client.complete(
            PROMPT,
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            logprobs=True,
            adapter=adapter,
        )
    assert done.reason == "LENGTH", done.finished
    return list(done.token_ids), list(done.logprobs)


def admin_call(target: str, method: str, request: object, token: str | None = ADMIN_TOKEN):  # type: ignore[no-untyped-def]
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(target) as channel:
        return getattr(admin_pb2_grpc.AdminStub(channel), method)(
            request, metadata=metadata, timeout=60
        )


def refusal(call) -> tuple[grpc.StatusCode, list[str]]:  # type: ignore[no-untyped-def]
    """(status code, BadRequest fields) of a failed call."""
    with pytest.raises(grpc.RpcError) as failed:
        call()
    fields = []
    status = rpc_status.from_call(failed.value)
    for detail in status.details if status else []:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return failed.value.code(), fields


def listed(target: str) -> dict[str, Any]:
    with Client(target) as client:
        return {a.name: a for a in client.info().adapters}


def assert_same_as_peft(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]):  # type: ignore[no-untyped-def]
    assert got[0] == want[0]
    assert max(abs(g - w) for g, w in zip(got[1], want[1], strict=True)) < 1e-4
