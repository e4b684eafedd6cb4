"""VllmEngine.Generate over a real grpc channel against the tiny checkpoint: the same tokens and
logprobs as sluice.v1 Generate, the stream and non-stream shapes, n, stops, structured output,
refusals by the worker protocol's field names, Abort and disconnects."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import jsonschema
import pytest
import pytest_asyncio
from sluice.v1 import generation_pb2 as pb
from sluice.v1 import generation_pb2_grpc
from tokenizers import Tokenizer

from service.vllm_worker.pb import common_pb2
from service.vllm_worker.pb import vllm_engine_pb2 as vpb
from tests.support.service_harness import running_server
from tests.support.worker_calls import engine_stub, generate, violation_fields

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT_IDS = [1, 17, 42, 99, 123, 7, 88, 5]
PROMPT_TEXT = "The quick brown fox"
VERSION = 3  # the served policy version (--policy-version)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path):
    async with running_server(
        tiny_llama, fake=False, engine={"num_kv_pages": 128, "policy_version": VERSION}
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(server[1]) as channel:
        yield channel


async def sluice_generate(channel: grpc.aio.Channel, request: pb.GenerateRequest):
    """(started, token chunks, finished) of a sluice.v1 Generate with n = 1."""
    started, chunks, finished = None, [], None
    async for event in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
        match event.WhichOneof("event"):
            case "started":
                started = event.started
            case "tokens":
                chunks.append(event.tokens)
            case "finished":
                finished = event.finished
    return started, chunks, finished


def worker_request(prompt: str | list[int], stream: bool = False, **params) -> vpb.GenerateRequest:
    request = vpb.GenerateRequest(
        request_id=params.pop("request_id", ""),
        stream=stream,
        sampling_params=vpb.SamplingParams(**params),
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.tokenized.input_ids.extend(prompt)
    return request


@pytest.mark.parametrize("prompt", [PROMPT_TEXT, PROMPT_IDS], ids=["text", "token_ids"])
async def test_greedy_equals_sluice_generate_token_for_token_and_logprob_for_logprob(
    channel, prompt
) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
    worker = await generate(
        channel, worker_request(prompt, logprobs=3, prompt_logprobs=2, **greedy)
    )
    reference = pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0.0),
        stop=pb.StopParams(max_tokens=10, ignore_eos=True),
        output=pb.OutputOptions(
            logprobs=True, top_logprobs=3, prompt_logprobs=True, raw_logprobs=True
        ),
    )
    if isinstance(prompt, str):
        reference.text = prompt
    else:
        reference.token_ids.ids.extend(prompt)
    started, chunks, finished = await sluice_generate(channel, reference)
    ids = [t for c in chunks for t in c.token_ids]
    done = worker.complete()
    assert worker.chunks == [] and len(worker.completes) == 1
    assert list(done.output_ids) == ids and len(ids) == 10
    assert (done.finish_reason, done.completion_tokens) == ("length", 10)
    assert done.prompt_tokens == started.prompt_tokens
    assert list(done.output_logprobs.token_ids) == ids
    assert list(done.output_logprobs.token_logprobs) == [lp for c in chunks for lp in c.logprobs]
    tops = [t for c in chunks for t in c.top_logprobs]
    assert [list(t.token_ids) for t in done.output_logprobs.top_logprobs] == [
        list(t.token_ids) for t in tops
    ]
    assert [list(t.values) for t in done.output_logprobs.top_logprobs] == [
        list(t.logprobs) for t in tops
    ]
    # The prompt: one entry per token, the first without a value; top 2 of sluice's top 3.
    scores = done.input_logprobs
    assert len(scores.token_ids) == started.prompt_tokens
    assert not scores.token_logprobs[0].HasField("value")
    assert [e.value for e in scores.token_logprobs[1:]] == list(started.prompt_logprobs.logprobs)
    assert [list(t.token_ids) for t in scores.top_logprobs[1:]] == [
        list(t.token_ids[:2]) for t in started.prompt_logprobs.top_logprobs
    ]
    assert finished.reason == pb.FINISH_REASON_LENGTH


async def test_a_stream_sends_chunks_then_one_complete_with_versions_in_metadata(
    channel,
) -> None:
    request = worker_request(
        PROMPT_IDS,
        stream=True,
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
    )
    streamed = await generate(channel, request)
    whole = await generate(
        channel, worker_request(PROMPT_IDS, temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert streamed.streamed_ids() == list(whole.complete().output_ids)
    assert sum(c.completion_tokens for c in streamed.chunks) == 8
    assert [c.HasField("input_logprobs") for c in streamed.chunks] == [True] + [False] * (
        len(streamed.chunks) - 1
    )
    assert all(len(c.output_logprobs.token_ids) == len(c.token_ids) for c in streamed.chunks)
    assert all(not c.output_logprobs.top_logprobs for c in streamed.chunks)  # logprobs=0
    done = streamed.complete()
    assert list(done.output_ids) == [] and done.completion_tokens == 8
    assert done.finish_reason == "length" and done.prompt_tokens == len(PROMPT_IDS)
    assert streamed.initial["sluice-policy-version"] == str(VERSION)
    spans = json.loads(streamed.trailing["sluice-version-spans"])
    assert spans == {"0": [{"policy_version": VERSION, "start": 0, "end": 8}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_n_samples_each_end_with_their_own_complete(channel, stream) -> None:
    request = worker_request(
        PROMPT_IDS, stream=stream, n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True
    )
    done = await generate(channel, request)
    assert sorted(c.index for c in done.completes) == [0, 1]
    for index in (0, 1):
        ids = done.streamed_ids(index) if stream else list(done.complete(index).output_ids)
        assert len(ids) == 6 and done.complete(index).completion_tokens == 6
    assert set(json.loads(done.trailing["sluice-version-spans"])) == {"0", "1"}


async def test_a_stop_token_id_and_a_stop_string_are_the_matched_stop(channel, tiny_llama) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    ids = list(
        (await generate(channel, worker_request(PROMPT_IDS, **greedy))).complete().output_ids
    )
    stop_id = ids[4]
    by_id = (
        await generate(channel, worker_request(PROMPT_IDS, stop_token_ids=[stop_id], **greedy))
    ).complete()
    assert list(by_id.output_ids) == ids[: ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.matched_token_id == stop_id

    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    text = tokenizer.decode(ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    by_string = (
        await generate(channel, worker_request(PROMPT_IDS, stop=[stop], **greedy))
    ).complete()
    assert by_string.finish_reason == "stop" and by_string.matched_stop_str == stop
    _, chunks, finished = await sluice_generate(
        channel,
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling=pb.SamplingParams(temperature=0.0),
            stop=pb.StopParams(max_tokens=12, ignore_eos=True, stop=[stop]),
        ),
    )
    assert (finished.reason, finished.matched_stop) == (pb.FINISH_REASON_STOP_STRING, stop)
    assert list(by_string.output_ids) == [t for c in chunks for t in c.token_ids]


async def test_json_schema_output_validates(channel, tiny_llama) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    request = worker_request(
        PROMPT_TEXT, temperature=0.0, max_tokens=40, json_schema=json.dumps(schema)
    )
    done = (await generate(channel, request)).complete()
    assert done.finish_reason == "stop"
    text = Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).decode(list(done.output_ids))
    jsonschema.validate(json.loads(text), schema)


UNSUPPORTED = [
    ("sampling_params.structural_tag", {"sampling_params": {"structural_tag": "{}"}}),
    ("sampling_params.truncate_prompt_tokens", {"sampling_params": {"truncate_prompt_tokens": 4}}),
    ("sampling_params.logprobs", {"sampling_params": {"logprobs": -1}}),
    ("sampling_params.prompt_logprobs", {"sampling_params": {"prompt_logprobs": -1}}),
    ("sampling_params.logit_bias", {"sampling_params": {"logit_bias": {-3: 1.0}}}),
    ("kv_transfer_params", {"kv_transfer_params": vpb.KvTransferParams(remote_host="h")}),
    ("kv_transfer_params_json", {"kv_transfer_params_json": "{}"}),
    ("mm_inputs", {"mm_inputs": vpb.MultimodalInputs(mm_hashes=["x"])}),
    ("extra_mm_inputs", {"extra_mm_inputs": [vpb.MultimodalInputs()]}),
    (
        "media_refs",
        {
            "media_refs": vpb.MediaRefs(
                items=[vpb.MediaRef(modality=common_pb2.IMAGE, url="data:,")]
            )
        },
    ),
    ("data_parallel_rank", {"data_parallel_rank": 1}),
    # Refused by sluice.v1's admission, named as the worker protocol names the field.
    ("sampling_params.top_p", {"sampling_params": {"top_p": 1.5}}),
    ("tokenized.input_ids", {"tokenized": vpb.TokenizedInput(input_ids=[10**6])}),
    ("sampling_params.json_schema", {"sampling_params": {"json_schema": "{not json"}}),
    ("sampling_params.regex", {"sampling_params": {"regex": "(unclosed"}}),
    ("sampling_params.stop", {"sampling_params": {"stop": [""]}}),
]


@pytest.mark.parametrize(("field", "fields"), UNSUPPORTED, ids=[f for f, _ in UNSUPPORTED])
async def test_a_field_sluice_cannot_honour_is_refused_naming_it(channel, field, fields) -> None:
    params = vpb.SamplingParams(max_tokens=4, **fields.pop("sampling_params", {}))
    request = vpb.GenerateRequest(sampling_params=params, **fields)
    if not request.HasField("tokenized"):
        request.text = PROMPT_TEXT
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(channel, request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violation_fields(refused.value) == [field]
    assert field in (refused.value.details() or "")


async def test_data_parallel_rank_zero_is_this_worker(channel) -> None:
    request = worker_request(PROMPT_IDS, temperature=0.0, max_tokens=2)
    request.data_parallel_rank = 0
    assert (await generate(channel, request)).complete().completion_tokens == 2


async def first_chunk_of_a_long_stream(channel, request_id: str):
    """A streaming call that would run long, once its first chunk arrived."""
    request = worker_request(
        PROMPT_IDS, stream=True, request_id=request_id, max_tokens=400, ignore_eos=True
    )
    call = engine_stub(channel).Generate(request, timeout=120)
    first = await call.read()
    assert first.WhichOneof("response") == "chunk"
    return call


async def test_abort_cancels_a_request_in_flight(channel) -> None:
    call = await first_chunk_of_a_long_stream(channel, "to-abort")
    await engine_stub(channel).Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown"]))
    completes = []
    while (response := await call.read()) is not grpc.aio.EOF:
        if response.WhichOneof("response") == "complete":
            completes.append(response.complete)
    assert [c.finish_reason for c in completes] == ["abort"]
    assert completes[0].completion_tokens < 400


async def test_a_client_that_goes_away_cancels_its_request(channel, server) -> None:
    call = await first_chunk_of_a_long_stream(channel, "to-leave")
    assert server[0].engine.has("to-leave")
    call.cancel()
    deadline = time.monotonic() + 30
    while server[0].engine.has("to-leave") and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # polls the condition, bounded: the abort is asynchronous
    assert not server[0].engine.has("to-leave")
