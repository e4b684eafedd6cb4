"""The vendored worker protocol is the pinned smg-grpc-proto release's, byte for byte."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest
import smg_grpc_proto

REPO = Path(__file__).resolve().parents[3]
VENDORED = REPO / "third_party" / "smg_grpc_proto"


@pytest.mark.parametrize("name", ["common.proto", "vllm_engine.proto"])
def test_vendored_proto_equals_the_pinned_release(name: str) -> None:
    assert version("smg-grpc-proto") == "0.4.28"
    published = Path(smg_grpc_proto.__file__).parent / "proto" / name
    assert (VENDORED / name).read_bytes() == published.read_bytes()


def test_the_stubs_serve_the_published_service_name() -> None:
    from service.vllm_worker.pb import vllm_engine_pb2

    service = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]
    assert service.full_name == "vllm.grpc.engine.VllmEngine"
    assert "SubscribeKvEvents" in service.methods_by_name
