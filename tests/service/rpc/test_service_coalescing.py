"""Coalescing: tokens that wait while a stream's previous event is written go out as one chunk;
an idle stream sends each token alone; nothing is lost or reordered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sluice.v1 import generation_pb2 as pb

from engine.protocol.config import EngineConfig
from engine.protocol.messages import AddRequest, FinishReason, RequestOutput, SamplingParams
from service.config import ServiceConfig
from service.engine_link.routing import Inbox
from service.ops.metrics import Metrics
from service.rpc.admission import Admission
from service.rpc.generate_stream import Admitted, GenerateStreamCall, StreamLimits
from service.rpc.servicer import GenerationServicer, Submitted
from service.text.completion import OutputSettings
from service.text.tokenizer import Tokenizer
from tests.support.service_harness import make_fake_model

IDS = [104, 101, 108, 108, 111]  # the ids the fake engine "generates", in order
LIMITS = StreamLimits(max_requests=8, max_buffer_bytes=2**20, idle_timeout=60.0)


class _Engine:
    """The two EngineClient methods `_run` calls; records aborts."""

    def __init__(self) -> None:
        self.aborted: list[tuple[list[str], FinishReason]] = []

    def abort(self, request_ids: list[str], reason: FinishReason, index: int | None = None):
        self.aborted.append((request_ids, reason))

    def detach(self, request_id: str) -> None:
        pass


def output(rid: str, k: int) -> RequestOutput:
    """The k-th output of request `rid`: token IDS[k]; the last one finishes it."""
    last = k == len(IDS) - 1
    return RequestOutput(
        rid,
        0,
        [IDS[k]],
        0,
        finish_reason=FinishReason.LENGTH if last else None,
        prompt_tokens=3 if k == 0 else 0,
        completion_tokens=k + 1,
    )


@pytest.fixture
def servicer(tmp_path: Path) -> GenerationServicer:
    model = make_fake_model(tmp_path / "model")
    config = ServiceConfig(engine=EngineConfig(model=str(model)))
    servicer = GenerationServicer(config, _Engine(), Metrics())  # type: ignore[arg-type]
    servicer.tokenizer = Tokenizer(model)
    return servicer


def submit(servicer: GenerationServicer, rid: str) -> tuple[Inbox, Admitted]:
    request = AddRequest(rid, [5, 6, 7], SamplingParams(max_tokens=len(IDS)))
    queue = Inbox()
    events = servicer.events(Submitted(Admission(request, OutputSettings()), queue, None))
    return queue, Admitted(rid, 1, 3, events)


def tokens(event: pb.GenerateResponse) -> list[int]:
    assert event.WhichOneof("event") == "tokens", event
    return list(event.tokens.token_ids)


async def test_generate_sends_an_idle_token_alone_and_tokens_that_waited_together(servicer):
    queue, admitted = submit(servicer, "r")
    events = admitted.events
    queue.put_nowait(output("r", 0))
    assert (await anext(events)).WhichOneof("event") == "started"
    alone = await anext(events)
    assert tokens(alone) == IDS[:1]
    # The generator is suspended at that yield (its message being written): what the engine
    # produces meanwhile waits in the queue and goes out as one chunk.
    for k in range(1, len(IDS)):
        queue.put_nowait(output("r", k))
    together = await anext(events)
    assert tokens(together) == IDS[1:]
    assert alone.tokens.text + together.tokens.text == servicer.tokenizer.decode(IDS)
    assert (await anext(events)).finished.usage.completion_tokens == len(IDS)


async def test_generate_stream_merges_what_came_while_the_previous_event_was_written(servicer):
    queues: dict[str, Inbox] = {}

    async def start(request: pb.GenerateRequest) -> Admitted:
        queues[request.request_id], admitted = submit(servicer, request.request_id)
        return admitted

    async def requests() -> AsyncIterator[pb.GenerateStreamRequest]:
        for rid in ("a", "b"):
            yield pb.GenerateStreamRequest(start=pb.GenerateRequest(request_id=rid))

    call = GenerateStreamCall(start, lambda ids: None, LIMITS)
    stream = call.run(requests())
    first = asyncio.ensure_future(anext(stream))
    while len(queues) < 2:  # both admitted
        await asyncio.sleep(0)
    for rid in ("a", "b"):
        queues[rid].put_nowait(output(rid, 0))
    sent = [await first, await anext(stream)]  # both `started`; the consumer is "writing"
    # Every step's outputs arrive while the consumer is suspended at a yield.
    for k in range(1, len(IDS)):
        for rid in ("a", "b"):
            queues[rid].put_nowait(output(rid, k))
        await asyncio.sleep(0)
    sent += [event async for event in stream]
    assert call.failure is None
    for rid in ("a", "b"):
        mine = [e for e in sent if e.request_id == rid]
        kinds = [e.WhichOneof("event") for e in mine]
        assert kinds == ["started", "tokens", "tokens", "finished"], kinds
        # The first token was already queued; the rest waited together and go out as one.
        assert [tokens(e) for e in mine[1:3]] == [IDS[:1], IDS[1:]]
        assert "".join(e.tokens.text for e in mine[1:3]) == servicer.tokenizer.decode(IDS)


async def test_a_cancelled_generate_stream_aborts_requests_waiting_for_their_write(servicer):
    queues: dict[str, Inbox] = {}

    async def start(request: pb.GenerateRequest) -> Admitted:
        queues[request.request_id], admitted = submit(servicer, request.request_id)
        return admitted

    async def requests() -> AsyncIterator[pb.GenerateStreamRequest]:
        yield pb.GenerateStreamRequest(start=pb.GenerateRequest(request_id="a"))
        await asyncio.Event().wait()  # the caller keeps its side open

    stream = GenerateStreamCall(start, lambda ids: None, LIMITS).run(requests())
    first = asyncio.ensure_future(anext(stream))
    while "a" not in queues:
        await asyncio.sleep(0)
    queues["a"].put_nowait(output("a", 0))
    assert (await first).WhichOneof("event") == "started"
    queues["a"].put_nowait(output("a", 1))
    await asyncio.sleep(0.01)  # the pump now waits for `started` to be written
    await stream.aclose()  # the caller went away
    assert servicer.engine.aborted == [(["a"], FinishReason.CANCELLED)]


async def test_an_inbox_hands_over_everything_waiting_at_once_in_order():
    inbox = Inbox()
    taking = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    assert not taking.done()  # nothing yet: it waits
    inbox.put_nowait(output("r", 0))
    inbox.put_nowait(output("r", 1))
    assert [o.new_token_ids for o in await taking] == [IDS[:1], IDS[1:2]]
    inbox.put_nowait(output("r", 2))
    assert [o.new_token_ids for o in await inbox.take()] == [IDS[2:3]]
    cancelled = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    cancelled.cancel()  # a handler that left
    inbox.put_nowait(output("r", 0))  # still delivered to whoever takes next
    assert len(await inbox.take()) == 1


async def test_an_interval_holds_a_streams_tokens_and_sends_them_together() -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(interval=0.05)
    inbox.put_nowait(output("r", 0))
    first_taken = loop.time()  # no later than the take's own clock reading
    assert await inbox.take() == [output("r", 0)]  # the first chunk goes at once
    inbox.put_nowait(output("r", 1))
    take = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    inbox.put_nowait(output("r", 2))  # arrives while the interval is held
    assert await take == [output("r", 1), output("r", 2)]
    assert loop.time() - first_taken >= 0.05


async def test_a_final_output_cuts_the_interval_short() -> None:
    inbox = Inbox(interval=60.0)
    inbox.put_nowait(output("r", 0))
    await inbox.take()
    take = asyncio.ensure_future(inbox.take())
    inbox.put_nowait(output("r", 3))
    await asyncio.sleep(0.01)
    assert not take.done()  # held: the interval has 60 s to run
    inbox.put_nowait(output("r", 4))  # the last one
    assert await asyncio.wait_for(take, 5.0) == [output("r", 3), output("r", 4)]
    # A final output already waiting is not held either.
    inbox = Inbox(interval=60.0)
    inbox.put_nowait(output("s", 0))
    await inbox.take()
    inbox.put_nowait(output("s", 3))
    inbox.put_nowait(output("s", 4))
    assert await asyncio.wait_for(inbox.take(), 5.0) == [output("s", 3), output("s", 4)]


async def test_generate_with_an_interval_sends_the_first_token_alone_then_the_rest_in_one_chunk(
    servicer,
):
    request = AddRequest("r", [5, 6, 7], SamplingParams(max_tokens=len(IDS)))
    inbox = Inbox(interval=60.0)
    events = servicer.events(Submitted(Admission(request, OutputSettings()), inbox, None))
    inbox.put_nowait(output("r", 0))
    assert (await anext(events)).WhichOneof("event") == "started"
    assert tokens(await anext(events)) == IDS[:1]
    chunk = asyncio.ensure_future(anext(events))
    for k in range(1, len(IDS) - 1):
        inbox.put_nowait(output("r", k))
        await asyncio.sleep(0.005)
    assert not chunk.done()
    inbox.put_nowait(output("r", len(IDS) - 1))  # final: sent at once with what waited
    assert tokens(await asyncio.wait_for(chunk, 5.0)) == IDS[1:]
    assert (await anext(events)).finished.usage.completion_tokens == len(IDS)


def test_the_stream_interval_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="stream_interval"):
        ServiceConfig(engine=EngineConfig(model=str(tmp_path)), stream_interval=-0.01)
