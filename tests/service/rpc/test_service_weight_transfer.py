"""Admin.InitWeightTransfer and UpdateWeights' distributed source: the fields the service
validates, over a real grpc.aio server and a fake engine (none of these reach it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import admin_pb2 as apb
from sluice_client import Client, build_header

from tests.support.service_harness import make_fake_model, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_TOKEN = "adm1n-s3cret"
GOOD = {
    "master_address": "127.0.0.1",
    "master_port": 29500,
    "world_size": 2,
    "rank_offset": 1,
    "group_name": "g",
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tmp_path_factory):
    model = make_fake_model(tmp_path_factory.mktemp("fake"))
    async with running_server(model, admin_token=ADMIN_TOKEN, stall_timeout=30.0) as (_, t):
        yield t


def violations(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    return [v.field for v in bad.field_violations]


async def refused(call) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as raised:
        await asyncio.to_thread(call)
    return raised.value


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"master_address": ""}, "master_address"),
        ({"master_port": 0}, "master_port"),
        ({"rank_offset": 0}, "rank_offset"),
        ({"world_size": 1}, "world_size"),
        ({"backend": "mpi"}, "backend"),
        ({"group_name": ""}, "group_name"),
        ({"timeout_ms": 30_001}, "timeout_ms"),  # past --stall-timeout
        # Sizes that froze (a full mesh of 2**31 - 1 ranks) or crashed (past int32) an engine:
        ({"world_size": 4097}, "world_size"),
        ({"world_size": 2**31 - 1}, "world_size"),
        ({"world_size": 2**32 - 1}, "world_size"),
        ({"world_size": 4096, "rank_offset": 2**32 - 1}, "world_size"),
        ({"master_address": "h" * 254}, "master_address"),
        ({"master_address": "host name"}, "master_address"),
        ({"master_address": "host\x00"}, "master_address"),
        ({"group_name": "g" * 257}, "group_name"),
        ({"group_name": "g\nh"}, "group_name"),
    ],
)
async def test_a_bad_rendezvous_is_invalid_argument_naming_the_field(target, change, field):
    request = apb.InitWeightTransferRequest(**(GOOD | change))
    with Client(target, admin_token=ADMIN_TOKEN) as admin:
        error = await refused(lambda: admin.init_weight_transfer(request))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violations(error) == [field]


@pytest.mark.parametrize(
    ("tensors", "bucket_bytes", "field"),
    [
        ([], None, "header.distributed.tensors"),
        ([apb.TensorSpec(name="", dtype="F32", shape=[2])], None, "header.distributed.tensors[0].name"),
        ([apb.TensorSpec(name="w", dtype="F64", shape=[2])], None, "header.distributed.tensors[0].dtype"),
        ([apb.TensorSpec(name="w", dtype="F32", shape=[])], None, "header.distributed.tensors[0].shape"),
        ([apb.TensorSpec(name="w", dtype="F32", shape=[2, 0])], None, "header.distributed.tensors[0].shape"),
        ([apb.TensorSpec(name="w", dtype="F32", shape=[2])], 0, "header.distributed.bucket_bytes"),
    ],
)  # fmt: skip
async def test_a_bad_distributed_source_is_invalid_argument_naming_the_field(
    target, tensors, bucket_bytes, field
):
    source = apb.DistributedSource(tensors=tensors, bucket_bytes=bucket_bytes)
    requests = [apb.UpdateWeightsRequest(header=build_header(distributed=source))]
    with Client(target, admin_token=ADMIN_TOKEN) as admin:
        error = await refused(
            lambda: list(
                admin.admin_stub.UpdateWeights(iter(requests), metadata=admin.admin_metadata)
            )
        )
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violations(error) == [field]


async def test_init_weight_transfer_needs_the_admin_token(target):
    with Client(target) as anonymous:
        error = await refused(
            lambda: anonymous.init_weight_transfer(apb.InitWeightTransferRequest(**GOOD))
        )
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED
