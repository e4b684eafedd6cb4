"""The Generation servicer over a real grpc.aio server and a fake engine process."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
from google.rpc import code_pb2, error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, Collector, build_request

from engine.protocol.messages import FinishReason, RequestOutput
from service.engine_link.routing import Inbox
from service.ops.metrics import Metrics
from service.rpc.admission import AddRequest, Admission, SamplingParams
from service.rpc.servicer import GenerationServicer, Submitted
from service.text.completion import OutputSettings
from service.text.tokenizer import Tokenizer
from tests.support.service_harness import make_fake_model, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

HOLD, DIE = 300, 301  # token ids the fake engine treats specially


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), hold_token=HOLD, die_on_token=DIE)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model_dir):
    async with running_server(model_dir) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with AsyncClient(server[1]) as c:
        yield c


async def collect(client, request):
    collector, events = Collector(), []
    async for event in client.generate(request):
        events.append(event)
        collector.add(event)
    return events, collector


async def free_pages_back(client) -> bool:
    for _ in range(100):
        info = await client.info()
        if info.kv_cache.free_pages == info.kv_cache.total_pages:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_started_first_then_echoed_tokens_then_one_finished(client):
    events, collector = await collect(client, build_request([0, 5, 6, 7], max_tokens=5))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert kinds.count("started") == 1 and kinds.count("finished") == 1
    (completion,) = collector.completions.values()
    assert completion.token_ids == [5, 6, 7, 5, 6]
    assert completion.reason == "LENGTH"
    assert completion.started.prompt_tokens == 4
    assert completion.finished.usage.completion_tokens == 5
    assert [(s.start, s.end) for s in completion.finished.version_spans] == [(0, 5)]
    assert len({e.request_id for e in events}) == 1 and events[0].request_id


async def test_chunk_texts_concatenate_to_the_decode_of_all_ids(client, model_dir):
    text = "Café 日本語 😀!"
    completion = await client.complete(text, max_tokens=40)
    tok = Tokenizer(model_dir)
    assert completion.text == tok.decode(completion.token_ids)
    assert "😀" in completion.text


async def test_stop_string_split_across_tokens_finishes_with_stop_string(client, model_dir):
    completion = await client.complete("abcdefghij", max_tokens=30, stop=["efg"])
    assert completion.reason == "STOP_STRING"
    assert completion.finished.matched_stop == "efg"
    assert completion.text == "abcd"  # the prompt echoed after BOS, cut at the stop
    assert await free_pages_back(client)


async def test_included_stop_string_stays_in_the_text(client):
    completion = await client.complete(
        "abcdefghij", max_tokens=30, stop=["efg"], include_stop_str_in_output=True
    )
    assert completion.text == "abcdefg"


async def test_logprobs_pair_with_token_ids(client):
    completion = await client.complete([0, 5, 6], max_tokens=3, logprobs=True)
    assert len(completion.logprobs) == len(completion.token_ids) == 3


async def test_stop_token_id_finishes_with_stop(client):
    completion = await client.complete([0, 5, 6, 7], max_tokens=10, stop_token_ids=[7])
    assert completion.reason == "STOP" and completion.token_ids == [5, 6, 7]


async def test_cancel_ends_the_request_cancelled_and_lists_unknown_ids(client):
    events = client.generate(build_request([0, HOLD, 5], request_id="held-1", max_tokens=5))
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.2)
    response = await client.cancel(["held-1", "nope"])
    assert list(response.cancelled) == ["held-1"] and list(response.not_found) == ["nope"]
    assert (await first).WhichOneof("event") == "started"
    last = [e async for e in events][-1]
    assert last.finished.reason == pb.FINISH_REASON_CANCELLED


async def test_duplicate_request_id_in_flight_is_already_exists(client):
    held = client.generate(build_request([0, HOLD], request_id="dup", max_tokens=5))
    first = asyncio.ensure_future(anext(held))
    await asyncio.sleep(0.2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(build_request([0, 5], request_id="dup", max_tokens=1))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await client.cancel(["dup"])
    await first
    assert [e async for e in held][-1].finished.reason == pb.FINISH_REASON_CANCELLED


async def test_client_disconnect_aborts_the_request_in_the_engine(client, server):
    events = client.generate(build_request([0, HOLD], request_id="gone", max_tokens=5))
    waiting = asyncio.ensure_future(anext(events))  # held: no event ever comes
    for _ in range(250):  # on a loaded machine the call may take a while to reach the engine
        if server[0].engine.has("gone"):
            break
        await asyncio.sleep(0.02)
    assert server[0].engine.has("gone")
    waiting.cancel()  # the client walks away: the iterator closes and cancels the call
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for _ in range(100):
        if not server[0].engine.has("gone"):
            break
        await asyncio.sleep(0.02)
    assert not server[0].engine.has("gone")
    assert await free_pages_back(client)


async def test_generate_stream_multiplexes_and_cancels_by_id(client):
    stream = client.stream()
    for i in range(4):
        await stream.start([0, 5, 6], request_id=f"s{i}", max_tokens=3)
    await stream.start([0, HOLD], request_id="s-held", max_tokens=3)
    await stream.start([0, 5], request_id="s-bad", temperature=-1.0)
    await asyncio.sleep(0.2)
    await stream.cancel("s-held")
    await stream.done_sending()
    collector = Collector()
    async for event in stream:
        collector.add(event)
    reasons = {rid: c.reason for (rid, _), c in collector.completions.items()}
    assert reasons == {
        "s0": "LENGTH",
        "s1": "LENGTH",
        "s2": "LENGTH",
        "s3": "LENGTH",
        "s-held": "CANCELLED",
    }
    (bad,) = collector.refused
    assert bad.request_id == "s-bad" and bad.reason == "REFUSED"
    assert bad.refused.code == code_pb2.INVALID_ARGUMENT and bad.refused.start_index == 5
    assert [v.field for v in bad.refused.field_violations] == ["sampling.temperature"]


async def stream_events(client, *actions) -> list[pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    """Send ("start", request) and ("cancel", id) actions over one GenerateStream; every event."""
    stream = client.stream()
    for kind, value in actions:
        if kind == "start":
            await stream.start(value)
        else:  # read after every start before it is admitted or refused
            await stream.cancel(value)
    await stream.done_sending()
    return [event async for event in stream]


async def test_a_start_reusing_an_id_in_flight_is_refused_without_touching_the_original(client):
    events = await stream_events(
        client,
        ("start", build_request([0, HOLD], request_id="twice", max_tokens=2)),
        ("start", build_request([0, 5], request_id="twice", max_tokens=2)),
        ("cancel", "twice"),
    )
    kinds = [e.WhichOneof("event") for e in events if e.request_id == "twice"]
    assert sorted(kinds) == ["finished", "refused", "started"]
    (refused,) = [e.refused for e in events if e.HasField("refused")]
    assert refused.code == code_pb2.ALREADY_EXISTS and refused.start_index == 1
    (finished,) = [e.finished for e in events if e.HasField("finished")]
    assert finished.reason == pb.FINISH_REASON_CANCELLED  # the original's, from the engine
    collector = Collector()
    for event in events:
        collector.add(event)
    assert collector.completions[("twice", 0)].reason == "CANCELLED"
    assert [c.reason for c in collector.refused] == ["REFUSED"]


async def test_a_refused_start_without_an_id_is_known_by_its_start_index(client):
    events = await stream_events(
        client,
        ("start", build_request([0, 5], request_id="first", max_tokens=1)),
        ("cancel", "nothing-to-cancel"),  # cancels are not counted
        ("start", build_request([0, 5], max_tokens=1)),
        ("start", build_request([0, 5], temperature=-1.0)),
    )
    (refused,) = [e for e in events if e.HasField("refused")]
    assert refused.request_id == "" and refused.refused.start_index == 2
    assert refused.refused.code == code_pb2.INVALID_ARGUMENT
    assert "sampling.temperature" in refused.refused.message
    finished = [e.request_id for e in events if e.HasField("finished")]
    assert len(finished) == 2 and "first" in finished and "" not in finished


async def test_a_refusal_for_a_full_queue_carries_the_retry_delay(model_dir):
    async with (
        running_server(model_dir, max_waiting=1, retry_after=0.25) as (_, target),
        AsyncClient(target) as client,
    ):
        events = await stream_events(
            client,
            ("start", build_request([0, HOLD], request_id="waits", max_tokens=1)),
            ("start", build_request([0, 5], request_id="full", max_tokens=1)),
            ("cancel", "waits"),
        )
    (refused,) = [e.refused for e in events if e.HasField("refused")]
    # retry_after with its jitter, x 1 to 1.5
    assert refused.code == code_pb2.RESOURCE_EXHAUSTED and 250 <= refused.retry_delay_ms <= 375


BAD_REQUESTS = [
    ("no prompt", pb.GenerateRequest(), "prompt"),
    ("empty text", build_request(""), "text"),
    ("empty ids", build_request([]), "token_ids.ids"),
    ("id out of vocab", build_request([0, 320]), "token_ids.ids"),
    ("negative temperature", build_request("a", temperature=-0.5), "sampling.temperature"),
    ("top_p zero", build_request("a", top_p=0.0), "sampling.top_p"),
    ("negative top_k", build_request("a", top_k=-1), "sampling.top_k"),
    ("max_tokens zero", build_request("a", max_tokens=0), "stop.max_tokens"),
    ("min over max", build_request("a", max_tokens=2, min_tokens=3), "stop.min_tokens"),
    ("stop id out of vocab", build_request("a", stop_token_ids=[999]), "stop.stop_token_ids"),
    ("top_logprobs 21", build_request("a", top_logprobs=21), "output.top_logprobs"),
    ("n zero", build_request("a", n=0), "n"),
    ("n above max_num_seqs", build_request("a", n=9), "n"),
    ("empty stop string", build_request("a", stop=[""]), "stop.stop"),
    ("33 stop strings", build_request("a", stop=[f"s{i}" for i in range(33)]), "stop.stop"),
    ("257-character stop string", build_request("a", stop=["s" * 257]), "stop.stop"),
    ("257 stop token ids", build_request("a", stop_token_ids=[2] * 257), "stop.stop_token_ids"),
    # 64 tokens of at most 7 bytes (the tiny tokenizer's longest, "unhappy") are 448 bytes.
    ("text longer than the context can hold", build_request("a" * 449), "text"),
    # Judged by length before any id is looked at.
    ("as many ids as the context", build_request([0] * 63 + [999]), "prompt"),
    ("long request id", build_request("a", request_id="x" * 300), "request_id"),
    ("prompt too long", build_request([0] * 64), "prompt"),
]


@pytest.mark.parametrize(
    ("name", "request_", "field"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
async def test_bad_field_is_invalid_argument_naming_it(client, name, request_, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in violated_fields(err.value)


def violated_fields(error: grpc.aio.AioRpcError) -> list[str]:
    """The fields a refusal's google.rpc.BadRequest names."""
    status = rpc_status.from_call(error)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    return [v.field for v in bad.field_violations]


@pytest.fixture
def tokenizing_fails(server, monkeypatch):
    """Encoding any text in the server raises: a test passes only if nothing was encoded."""

    async def encode(text, add_special_tokens=True):
        raise AssertionError(f"{len(text)} characters were encoded")

    monkeypatch.setattr(server[0].servicer.tokenizer, "encode", encode)


async def test_a_10_mb_prompt_is_refused_without_tokenizing_it(client, tokenizing_fails):
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete("unhappy " * (10 * 2**20 // 8), max_tokens=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text" in violated_fields(err.value)
    assert time.monotonic() - started < 2.0


async def test_tokenize_refuses_a_text_that_could_not_be_a_prompt(client, tokenizing_fails):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.tokenize("x" * 100_000)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(err.value) == ["text"]


async def test_a_message_above_the_receive_limit_is_refused_and_the_server_serves_on(
    client, tokenizing_fails
):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete("x" * (17 * 2**20), max_tokens=1)  # default limit: 16 MiB
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    completion = await client.complete([0, 9], max_tokens=2)
    assert completion.reason == "LENGTH"


async def test_newer_min_policy_version_is_unavailable_with_a_retry_delay(server):
    async with AsyncClient(server[1], retry=False) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete("a", min_policy_version=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "min_policy_version 1 is newer" in (err.value.details() or "")
    status = rpc_status.from_call(err.value)
    assert status is not None
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)


async def test_past_deadline_is_deadline_exceeded(client):
    # The client's deadline or the engine's, whichever is noticed first.
    try:
        completion = await client.complete(build_request([0, HOLD]), timeout=0.3)
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert completion.reason == "DEADLINE_EXCEEDED", completion.reason
    assert await free_pages_back(client)


async def test_server_serves_after_bad_requests(client):
    completion = await client.complete([0, 9], max_tokens=2)
    assert completion.reason == "LENGTH"


async def test_tokenize_and_info(client, model_dir):
    assert (
        await client.tokenize("abc")
        == Tokenizer(model_dir)._tok.encode("abc", add_special_tokens=False).ids
    )
    info = await client.info()
    assert info.model == "fake" and info.state == pb.SERVING_STATE_SERVING
    assert info.vocab_size == 320 and info.max_model_len == 64
    assert info.tensor_parallel_size == 1  # the ranks a weight-transfer group must count


class _EngineStub:
    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, ids, reason):
        self.aborted += ids

    def detach(self, rid):
        pass


async def test_every_waiting_token_goes_out_as_one_chunk(model_dir):
    servicer = GenerationServicer.__new__(GenerationServicer)
    servicer.engine = _EngineStub()  # type: ignore[assignment]
    servicer.tokenizer = Tokenizer(model_dir)
    servicer.metrics = Metrics()
    queue = Inbox()
    for i, token in enumerate([36, 66, 71]):
        queue.put_nowait(
            RequestOutput(
                "r",
                0,
                [token],
                0,
                prompt_tokens=2 if i == 0 else 0,
                finish_reason=FinishReason.LENGTH if i == 2 else None,
            )
        )
    admission = Admission(AddRequest("r", [0, 36], SamplingParams(max_tokens=3)), OutputSettings())
    events = [e async for e in servicer.events(Submitted(admission, queue, None))]
    assert [e.WhichOneof("event") for e in events] == ["started", "tokens", "finished"]
    assert list(events[1].tokens.token_ids) == [36, 66, 71]


async def test_a_text_and_a_token_ids_prompt_past_the_context_get_one_message(client):
    text = "the cat sat on the mat " * 12
    ids = await client.tokenize(text, add_special_tokens=True)  # what the server makes of it
    assert len(ids) >= 64  # the fake model's context
    refused = []
    for prompt in (text, ids):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(prompt, max_tokens=1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(err.value) == ["prompt"]
        refused.append(err.value.details())
    assert refused[0] == refused[1], refused
    assert f"{len(ids)} prompt tokens leave no room in the context of 64 tokens" in refused[0]
