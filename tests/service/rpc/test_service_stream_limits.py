"""GenerateStream flow control: a caller that never reads, a stream at its request limit, an
idle stream, and one connection opening many streams; none of them starves the other callers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import structlog
from sluice.v1 import generation_pb2 as pb
from sluice.v1 import generation_pb2_grpc
from sluice_client import AsyncClient

from service.rpc import generate_stream
from service.rpc.generate_stream import Admitted, GenerateStreamCall, StreamLimits
from tests.support.service_harness import make_fake_model, running_server, stub

HOLD = 300
# A connection of its own (gRPC shares one between channels to the same target by default),
# with a fixed receive window: what it does not read backs up into the server at once.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(
        tmp_path_factory.mktemp("fake"), hold_token=HOLD, step_delay=0.001, max_model_len=8192
    )


def start(*ids: int, request_id: str = "", max_tokens: int = 4) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        start=pb.GenerateRequest(
            request_id=request_id,
            token_ids=pb.TokenIds(ids=list(ids)),
            stop=pb.StopParams(max_tokens=max_tokens),
            output=pb.OutputOptions(logprobs=True, top_logprobs=20),
        )
    )


async def nothing() -> AsyncIterator[pb.GenerateStreamRequest]:
    """A request stream that stays open and sends nothing."""
    await asyncio.Event().wait()
    yield pb.GenerateStreamRequest()  # pragma: no cover - never reached


async def wait_until(predicate, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


async def generate_ok(target: str) -> None:
    """Another caller, on a connection of its own, is served."""
    async with grpc.aio.insecure_channel(target, options=OWN_CONNECTION) as channel:
        generation = stub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[0, 5]), stop=pb.StopParams(max_tokens=2)
        )
        events = [event async for event in generation.Generate(request, timeout=10)]
        assert events[-1].finished.reason == pb.FINISH_REASON_LENGTH
        info = await generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.state == pb.SERVING_STATE_SERVING


@pytest.mark.timeout(60)
async def test_a_stream_that_never_reads_stops_being_fed_and_others_are_served(model_dir):
    # The sync client: the aio one may report INTERNAL instead of the status of a call the
    # server ends while the client still sends (grpc/grpc#36066).
    async with running_server(model_dir, max_stream_buffer_bytes=2**20) as (server, target):
        hang_up = threading.Event()

        def starts() -> Iterator[pb.GenerateStreamRequest]:
            for _ in range(3000):
                yield start(0, 5, 6, 7, max_tokens=4000)
            hang_up.wait()  # and keeps its side open

        channel = grpc.insecure_channel(target, options=OWN_CONNECTION)
        try:
            with structlog.testing.capture_logs() as logs:
                responses = generation_pb2_grpc.GenerationStub(channel).GenerateStream(starts())
                await wait_until(lambda: server.engine.in_flight > 0)
                # Its requests are cancelled and no more are admitted: the engine is left
                # empty while the caller still reads nothing (before: thousands in flight).
                await wait_until(lambda: server.engine.in_flight == 0)
                await generate_ok(target)
            (over,) = [e for e in logs if e["event"] == "stream.not_reading"]
            assert over["budget_bytes"] == 2**20
            assert over["in_flight"] <= server.config.max_stream_requests
            # What it finally reads: the events it left, then the reason.
            with pytest.raises(grpc.RpcError) as err:
                await asyncio.to_thread(lambda: sum(1 for _ in responses))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-stream-buffer-bytes" in (err.value.details() or "")
        finally:
            hang_up.set()
            channel.close()
        await wait_until(lambda: server.call_limit.in_use == 0)


@pytest.mark.timeout(60)
async def test_a_stream_that_never_reads_gives_its_slot_back_within_a_bound(model_dir):
    # Whether the server's last writes fit in the caller's receive window depends on timing:
    # the call ends either way (RESOURCE_EXHAUSTED written, or abandoned: see the next test).
    async with (
        running_server(model_dir, max_stream_buffer_bytes=2**20) as (server, target),
        grpc.aio.insecure_channel(target, options=OWN_CONNECTION) as channel,
    ):

        async def starts() -> AsyncIterator[pb.GenerateStreamRequest]:
            for _ in range(3000):
                yield start(0, 5, 6, 7, max_tokens=4000)
            await asyncio.Event().wait()

        with structlog.testing.capture_logs() as logs:
            call = stub(channel).GenerateStream(starts())  # never read
            await wait_until(lambda: any(e["event"] == "stream.not_reading" for e in logs))
            limit = 2 * generate_stream.FINALS_TIMEOUT + 5
            await wait_until(lambda: server.call_limit.in_use == 0, timeout=limit)
        assert server.engine.in_flight == 0
        call.cancel()


async def test_a_call_whose_write_never_completes_is_cancelled_once_past_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(generate_stream, "FINALS_TIMEOUT", 0.05)
    cancelled: list[str] = []

    async def events() -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id="r", started=pb.Started(prompt_tokens=2))
        await asyncio.Event().wait()  # the engine goes on producing into the request's Inbox

    async def admit(request: pb.GenerateRequest) -> Admitted:
        return Admitted("r", 1, 2, events())

    call = GenerateStreamCall(admit, cancelled.extend, StreamLimits(8, 100, 60.0))
    first_written = asyncio.Event()

    async def grpc_writer() -> None:
        """What grpc.aio does with the handler: write each event it yields; here the first
        write never completes (a caller that does not read, its receive window full)."""
        responses = call.run(_starts_then_silence())
        try:
            await anext(responses)
            first_written.set()
            await asyncio.Event().wait()
        finally:
            await responses.aclose()

    with structlog.testing.capture_logs() as logs:
        writer = asyncio.create_task(grpc_writer())
        await asyncio.wait_for(first_written.wait(), 5)
        call.meter.add(101)  # what the request's Inbox holds passes the call's budget
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(writer, 5)
    assert cancelled == ["r"]
    assert [e["event"] for e in logs if e["event"].startswith("stream.")] == [
        "stream.not_reading",
        "stream.abandoned",
    ]


async def _starts_then_silence() -> AsyncIterator[pb.GenerateStreamRequest]:
    yield start(0, 5)
    await asyncio.Event().wait()


async def test_a_stream_at_its_request_limit_reads_its_next_start_once_one_ends(model_dir):
    async with (
        running_server(model_dir, max_stream_requests=2) as (server, target),
        AsyncClient(target) as client,
    ):
        stream = client.stream(timeout=30)
        with structlog.testing.capture_logs() as logs:
            for request_id in ("h0", "h1"):
                await stream.start([0, HOLD], request_id=request_id)
            await stream.start([0, 5], request_id="s2", max_tokens=2)
            await wait_until(lambda: any(e["event"] == "stream.full" for e in logs))
        assert server.engine.has("h0") and server.engine.has("h1")
        assert not server.engine.has("s2")  # waits unread, neither admitted nor refused
        assert (await client.cancel(["h0"])).cancelled == ["h0"]
        await stream.done_sending()
        finished = {}
        async for event in stream:
            if event.HasField("finished"):
                finished[event.request_id] = event.finished.reason
                if event.request_id == "s2":
                    await client.cancel(["h1"])
        assert finished == {
            "h0": pb.FINISH_REASON_CANCELLED,
            "s2": pb.FINISH_REASON_LENGTH,
            "h1": pb.FINISH_REASON_CANCELLED,
        }


async def test_an_idle_stream_ends_aborted_but_one_with_a_request_in_flight_stays(model_dir):
    async with (
        running_server(model_dir, stream_idle_timeout=0.5) as (server, target),
        grpc.aio.insecure_channel(target) as channel,
        AsyncClient(target) as client,
    ):
        busy = client.stream(timeout=30)
        await busy.start([0, HOLD], request_id="held")
        await wait_until(lambda: server.engine.has("held"))
        idle = stub(channel).GenerateStream(nothing(), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await idle.read()
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "--stream-idle-timeout" in (err.value.details() or "")
        # The busy stream outlived an idle timeout; with its request over, it is idle too.
        assert server.engine.has("held")
        await client.cancel(["held"])
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for event in busy:
                events.append(event.WhichOneof("event"))
        assert events == ["started", "finished"]
        assert err.value.code() == grpc.StatusCode.ABORTED


async def test_one_connection_cannot_take_every_call_slot_with_idle_streams(model_dir):
    async with (
        running_server(model_dir, max_concurrent_rpcs=16) as (server, target),
        grpc.aio.insecure_channel(target, options=OWN_CONNECTION) as channel,
    ):
        calls = [stub(channel).GenerateStream(nothing()) for _ in range(16)]
        readers = [asyncio.ensure_future(call.read()) for call in calls]
        await wait_until(lambda: sum(r.done() for r in readers) == 8)
        refused = [r.exception() for r in readers if r.done()]
        assert all(isinstance(e, grpc.aio.AioRpcError) for e in refused)
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "--max-generate-streams-per-connection" in (refused[0].details() or "")
        assert server.call_limit.in_use == 8
        await generate_ok(target)  # the other half of the slots stays for the others
        for call in calls:
            call.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await wait_until(lambda: server.call_limit.in_use == 0 and not server.call_limit.streams)
