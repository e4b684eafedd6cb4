"""A hostile json_schema at admission: nested past Python's recursion limit, or using a keyword
that is not enforced. It is refused INVALID_ARGUMENT naming the field; in a GenerateStream that
start alone is refused and the stream's other requests run to their end."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import structlog
from sluice.v1 import generation_pb2 as pb

from service.rpc.generate_stream import Admitted, GenerateStreamCall, StreamLimits
from tests.support.service_harness import make_fake_model, running_server, stub

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEPTH = sys.getrecursionlimit() * 5  # 30 KB: inside the 64 KiB a document may have
DEEP = '{"a":' * DEPTH + "1" + "}" * DEPTH


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), step_delay=0.001)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(model_dir):
    async with running_server(model_dir) as (_, address):
        yield address


def request(
    max_tokens: int, json_schema: str | None = None, request_id: str = ""
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=[0, 5, 6]),
        stop=pb.StopParams(max_tokens=max_tokens),
    )
    if json_schema is not None:
        req.structured.json_schema = json_schema
    return req


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        (DEEP, f"structured.json_schema: is nested {DEPTH} deep, more than 64"),
        ('{"type": "object", "allOf": [{}]}', "structured.json_schema: allOf at # is not"),
        ('{"type": "string", "pattern": "^a", "maxLength": 3}', "maxLength beside pattern"),
    ],
    ids=["deep", "allOf", "pattern-and-length"],
)
async def test_a_bad_schema_is_invalid_argument_naming_the_field(target, schema, words) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub(channel).Generate(request(4, schema), timeout=20):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()


async def test_a_deep_schema_in_a_stream_refuses_that_start_alone(target) -> None:
    starts = [
        request(50, request_id="before"),
        request(4, DEEP, request_id="deep"),
        request(4, request_id="after"),
    ]

    async def messages() -> AsyncIterator[pb.GenerateStreamRequest]:
        for start in starts:
            yield pb.GenerateStreamRequest(start=start)

    async with grpc.aio.insecure_channel(target) as channel:
        events = [e async for e in stub(channel).GenerateStream(messages(), timeout=30)]
    refused = [e for e in events if e.WhichOneof("event") == "refused"]
    assert [(e.request_id, e.refused.start_index) for e in refused] == [("deep", 1)]
    assert refused[0].refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [v.field for v in refused[0].refused.field_violations] == ["structured.json_schema"]
    finished = {e.request_id: e.finished for e in events if e.WhichOneof("event") == "finished"}
    assert set(finished) == {"before", "after"}
    assert all(f.reason == pb.FINISH_REASON_LENGTH for f in finished.values())


async def test_a_start_whose_admission_fails_unexpectedly_is_refused_internal_alone() -> None:
    async def events(request_id: str) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id=request_id, finished=pb.Finished())

    async def admit(req: pb.GenerateRequest) -> Admitted:
        if req.request_id == "bug":
            raise RecursionError("maximum recursion depth exceeded")
        return Admitted(req.request_id, 1, 3, events(req.request_id))

    async def messages() -> AsyncIterator[pb.GenerateStreamRequest]:
        for rid in ("a", "bug", "b"):
            yield pb.GenerateStreamRequest(start=request(4, request_id=rid))

    call = GenerateStreamCall(admit, lambda ids: None, StreamLimits(8, 2**20, 60.0))
    with structlog.testing.capture_logs() as logs:
        out = [e async for e in call.run(messages())]
    assert call.failure is None
    refused = [e for e in out if e.WhichOneof("event") == "refused"]
    assert [(e.request_id, e.refused.start_index) for e in refused] == [("bug", 1)]
    assert refused[0].refused.code == grpc.StatusCode.INTERNAL.value[0]
    assert "RecursionError" in refused[0].refused.message
    assert sorted(e.request_id for e in out if e.WhichOneof("event") == "finished") == ["a", "b"]
    assert any(e["event"] == "stream.admission_failed" for e in logs)
