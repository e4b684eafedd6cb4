"""Request messages that do not parse: INVALID_ARGUMENT for every RPC, and nothing else breaks.

The calls go through a generic channel with no serializer, so that hand-made bytes reach the
server as they are; the synchronous channel (in a thread) reports early refusals of streaming
calls faithfully.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections import Counter

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, build_header, build_request

from tests.support.service_harness import make_fake_model, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_TOKEN = "adm1n"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
HOLD = 300

BAD_UTF8 = b"\x0a\x01\xff"  # field 1, a string here, holding the byte 0xff
CORRUPT = b"\x0a\x05ab"  # field 1 announces 5 bytes; 2 follow
BAD_CANCEL = b"\x12\x01\xff"  # GenerateStreamRequest.cancel_request_id = b"\xff"
BAD_HEADER = b"\x0a\x03\x12\x01\xff"  # UpdateWeightsRequest.header.checkpoint_dir = b"\xff"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), hold_token=HOLD)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model_dir, weights_dir):
    async with running_server(
        model_dir, admin_token=ADMIN_TOKEN, weights_dir=str(weights_dir)
    ) as running:
        yield running


class Outcome:
    def __init__(self) -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.responses: list[bytes] = []


def _raw_call(
    target: str, method: str, messages: list[bytes], metadata: tuple[tuple[str, str], ...] = ()
) -> Outcome:
    """Send `messages` as they are; `method` is '/package.Service/Name'. Streaming kinds are
    inferred from the method (GenerateStream and UpdateWeights stream both ways)."""
    outcome = Outcome()
    with grpc.insecure_channel(target) as channel:
        try:
            if method.endswith(("/GenerateStream", "/UpdateWeights")):
                call = channel.stream_stream(method)
                for response in call(iter(messages), metadata=metadata, timeout=20):
                    outcome.responses.append(response)
            elif method.endswith("/Generate"):
                for response in channel.unary_stream(method)(messages[0], timeout=20):
                    outcome.responses.append(response)
            else:
                outcome.responses.append(channel.unary_unary(method)(messages[0], timeout=20))
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code(), err.details()
    return outcome


async def raw_call(target: str, method: str, *messages: bytes, **kwargs) -> Outcome:  # type: ignore[no-untyped-def]
    return await asyncio.to_thread(_raw_call, target, method, list(messages), **kwargs)


async def serves(target: str) -> bool:
    async with AsyncClient(target) as client:
        return (await client.complete([0, 5], max_tokens=2)).reason == "LENGTH"


def start(prompt: list[int], request_id: str, **params) -> bytes:  # type: ignore[no-untyped-def]
    request = build_request(prompt, request_id=request_id, **params)
    return pb.GenerateStreamRequest(start=request).SerializeToString()


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("/sluice.v1.Generation/Generate", BAD_UTF8),
        ("/sluice.v1.Generation/Generate", CORRUPT),
        ("/sluice.v1.Generation/GenerateStream", BAD_CANCEL),
        ("/sluice.v1.Generation/GenerateStream", CORRUPT),
        ("/sluice.v1.Generation/Cancel", BAD_UTF8),
        ("/sluice.v1.Generation/Tokenize", BAD_UTF8),
        ("/sluice.v1.Generation/GetServerInfo", CORRUPT),
        ("/sluice.v1.Admin/UpdateWeights", BAD_HEADER),
        ("/sluice.v1.Admin/UpdateWeights", CORRUPT),
    ],
)
async def test_a_message_that_does_not_parse_is_invalid_argument(server, method, message):
    outcome = await raw_call(server[1], method, message, metadata=ADMIN)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome.details
    assert "could not be parsed" in outcome.details
    assert await serves(server[1])


async def test_a_missing_admin_token_is_refused_before_the_message_is_parsed(server):
    outcome = await raw_call(server[1], "/sluice.v1.Admin/UpdateWeights", BAD_HEADER)
    assert outcome.code == grpc.StatusCode.UNAUTHENTICATED


async def test_a_corrupt_chunk_frees_the_update_slot_and_leaves_no_file(server, weights_dir):
    header = apb.UpdateWeightsRequest(header=build_header(inline_tensors=True))
    outcome = await raw_call(
        server[1],
        "/sluice.v1.Admin/UpdateWeights",
        header.SerializeToString(),
        b"\x12\x05ab",  # a TensorChunk announcing 5 bytes; 2 follow
        metadata=ADMIN,
    )
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert list(weights_dir.iterdir()) == []
    applied = await raw_call(
        server[1],
        "/sluice.v1.Admin/UpdateWeights",
        apb.UpdateWeightsRequest(
            header=build_header(checkpoint_dir="/ckpt/ok")
        ).SerializeToString(),
        metadata=ADMIN,
    )
    assert applied.code == grpc.StatusCode.OK


def finished_by_id(responses: list[bytes]) -> dict[str, list[pb.Finished]]:
    finished: dict[str, list[pb.Finished]] = {}
    for raw in responses:
        event = pb.GenerateResponse.FromString(raw)
        if event.HasField("finished"):
            finished.setdefault(event.request_id, []).append(event.finished)
    return finished


async def test_a_bad_message_in_a_stream_finishes_every_admitted_request_then_ends_it(server):
    outcome = await raw_call(
        server[1],
        "/sluice.v1.Generation/GenerateStream",
        start([0, HOLD], "held-1"),
        start([0, HOLD], "held-2"),
        start([0, 5, 6], "short", max_tokens=3),
        BAD_CANCEL,
        start([0, 5], "after"),  # never read
    )
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "request message 3" in outcome.details
    finished = finished_by_id(outcome.responses)
    assert sorted(finished) == ["held-1", "held-2", "short"]
    assert [f.reason for f in finished["held-1"]] == [pb.FINISH_REASON_CANCELLED]
    assert [f.reason for f in finished["held-2"]] == [pb.FINISH_REASON_CANCELLED]
    assert len(finished["short"]) == 1
    assert not server[0].engine.has("held-1") and not server[0].engine.has("held-2")
    assert await serves(server[1])


@pytest.fixture
def quick_give_up(monkeypatch):
    monkeypatch.setattr("service.rpc.generate_stream.FINALS_TIMEOUT", 0.5)


async def test_a_stream_whose_engine_never_confirms_still_finishes_its_requests(
    model_dir, quick_give_up
):
    before = {p.pid for p in multiprocessing.active_children()}
    async with running_server(model_dir) as (_, target):
        (engine_pid,) = {p.pid for p in multiprocessing.active_children()} - before
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            outcome = await raw_call(
                target, "/sluice.v1.Generation/GenerateStream", start([0, HOLD], "r1"), BAD_CANCEL
            )
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
        events = [pb.GenerateResponse.FromString(r) for r in outcome.responses]
        kinds = Counter((e.request_id, e.WhichOneof("event")) for e in events)
        assert kinds == {("r1", "started"): 1, ("r1", "finished"): 1}
        assert events[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        assert await serves(target)
