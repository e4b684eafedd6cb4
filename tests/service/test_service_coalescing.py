"""Coalescing: tokens that wait together go out as one chunk; nothing is lost or reordered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from service_harness import make_fake_model
from sluice.v1 import generation_pb2 as pb

from engine.config import EngineConfig
from engine.messages import AddRequest, FinishReason, RequestOutput, SamplingParams
from service.admission import Admission
from service.coalescing import coalesce
from service.completion import OutputSettings
from service.config import ServiceConfig
from service.generate_stream import Admitted, GenerateStreamCall
from service.metrics import Metrics
from service.servicer import GenerationServicer, _Submitted
from service.tokenizer import Tokenizer


def chunk(rid: str, ids: list[int], text: str, index: int = 0, version: int = 0):
    tokens = pb.TokenChunk(
        token_ids=ids, text=text, logprobs=[-float(i) for i in ids], policy_version=version
    )
    tokens.top_logprobs.extend(pb.TopLogprobs(token_ids=[i], logprobs=[-0.5]) for i in ids)
    return pb.GenerateResponse(request_id=rid, index=index, tokens=tokens)


def started(rid: str):
    return pb.GenerateResponse(request_id=rid, started=pb.Started(prompt_tokens=3))


def finished(rid: str, index: int = 0):
    done = pb.Finished(reason=pb.FINISH_REASON_LENGTH)
    return pb.GenerateResponse(request_id=rid, index=index, finished=done)


def per_sample(events: list[pb.GenerateResponse]) -> dict[tuple[str, int], tuple]:
    """Each sample's event kinds (chunks collapsed), token ids, text, logprobs and top ids."""
    out: dict[tuple[str, int], tuple] = {}
    for event in events:
        kinds, ids, text, logprobs, tops = out.setdefault(
            (event.request_id, event.index), ([], [], [], [], [])
        )
        kind = event.WhichOneof("event")
        if not kinds or kinds[-1] != kind or kind != "tokens":
            kinds.append(kind)
        if kind == "tokens":
            ids += event.tokens.token_ids
            text.append(event.tokens.text)
            logprobs += event.tokens.logprobs
            tops += [t.token_ids[0] for t in event.tokens.top_logprobs]
    return {
        k: (tuple(a), tuple(b), "".join(c), tuple(d), tuple(e))
        for k, (a, b, c, d, e) in out.items()
    }


def test_chunks_of_one_sample_waiting_together_merge_in_order():
    events = [
        started("a"),
        chunk("a", [1], "x"),
        chunk("b", [7], "q"),
        chunk("a", [2, 3], "yz"),
        finished("b"),
        chunk("a", [4], "w"),
        finished("a"),
    ]
    expected = per_sample([pb.GenerateResponse.FromString(e.SerializeToString()) for e in events])
    merged = coalesce(events)
    assert [(e.request_id, e.WhichOneof("event")) for e in merged] == [
        ("a", "started"),
        ("a", "tokens"),
        ("b", "tokens"),
        ("b", "finished"),
        ("a", "finished"),
    ]
    assert list(merged[1].tokens.token_ids) == [1, 2, 3, 4]
    assert merged[1].tokens.text == "xyzw"
    assert per_sample(merged) == expected  # same tokens, text, logprobs and order per sample


def test_chunks_of_different_policy_versions_stay_apart():
    merged = coalesce([chunk("a", [1], "x", version=3), chunk("a", [2], "y", version=4)])
    assert [list(e.tokens.token_ids) for e in merged] == [[1], [2]]


def test_samples_of_one_request_are_not_merged_together():
    merged = coalesce([chunk("a", [1], "x", index=0), chunk("a", [2], "y", index=1)])
    assert [(e.index, list(e.tokens.token_ids)) for e in merged] == [(0, [1]), (1, [2])]


def test_a_chunk_after_another_event_of_its_sample_is_not_merged_across_it():
    merged = coalesce([chunk("a", [1], "x"), finished("a"), chunk("a", [2], "y")])
    assert [e.WhichOneof("event") for e in merged] == ["tokens", "finished", "tokens"]


async def test_generate_stream_merges_chunks_that_queued_while_it_was_writing():
    async def events() -> AsyncIterator[pb.GenerateResponse]:
        # All queued at once, as when a step's outputs arrive while a write is in flight.
        for event in [started("r"), chunk("r", [1], "a"), chunk("r", [2], "b"), finished("r")]:
            yield event

    async def start(request: pb.GenerateRequest) -> Admitted:
        return Admitted("r", 1, 3, events())

    async def requests() -> AsyncIterator[pb.GenerateStreamRequest]:
        yield pb.GenerateStreamRequest(start=pb.GenerateRequest(request_id="r"))

    call = GenerateStreamCall(start, lambda ids: None)
    sent = [event async for event in call.run(requests())]
    assert [e.WhichOneof("event") for e in sent] == ["started", "tokens", "finished"]
    assert list(sent[1].tokens.token_ids) == [1, 2] and sent[1].tokens.text == "ab"
    assert call.failure is None


class _Engine:
    """The two EngineClient methods `_run` calls."""

    def abort(self, request_ids: list[str], reason: FinishReason, index: int | None = None):
        raise AssertionError("nothing is aborted here")

    def detach(self, request_id: str) -> None:
        pass


def output(token: int, first: bool = False, last: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        0,
        [token],
        0,
        finish_reason=FinishReason.LENGTH if last else None,
        prompt_tokens=3 if first else 0,
    )


async def test_generate_sends_an_idle_token_alone_and_tokens_that_waited_together(
    tmp_path: Path,
):
    model = make_fake_model(tmp_path / "model")
    config = ServiceConfig(engine=EngineConfig(model=str(model)))
    servicer = GenerationServicer(config, _Engine(), Metrics())  # type: ignore[arg-type]
    servicer.tokenizer = tokenizer = Tokenizer(model)
    request = AddRequest("r", [5, 6, 7], SamplingParams(max_tokens=4))
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    events = servicer._run(_Submitted(Admission(request, OutputSettings()), queue, None))
    ids = [104, 101, 108, 108]

    queue.put_nowait(output(ids[0], first=True))
    assert (await anext(events)).WhichOneof("event") == "started"
    alone = await anext(events)
    assert list(alone.tokens.token_ids) == ids[:1]
    # The generator is suspended at that yield (its message being written): what the engine
    # produces meanwhile waits in the queue and goes out as one chunk.
    for k, token in enumerate(ids[1:], start=1):
        queue.put_nowait(output(token, last=k == len(ids) - 1))
    together = await anext(events)
    assert list(together.tokens.token_ids) == ids[1:]
    assert alone.tokens.text + together.tokens.text == tokenizer.decode(ids)
    assert (await anext(events)).finished.usage.completion_tokens == len(ids)
