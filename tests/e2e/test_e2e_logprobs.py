"""End to end: prompt logprobs (against HF's log-softmax), logprob modes and the sampling
support through a real server and engine."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, Collector, build_request

from service.text.tokenizer import Tokenizer
from tests.support.service_harness import running_server
from tests.support.tiny_models import load_hf_model

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

TEXT = "The quick brown fox jumps over the lazy dog. To be, or not to be"


@pytest.fixture(scope="module")
def prompt(tiny_llama: Path) -> list[int]:
    return Tokenizer(tiny_llama)._tok.encode(TEXT).ids


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: HF's log-softmax scoring prompt positions 1, 2, ..."""
    with torch.no_grad():
        logits = load_hf_model(tiny_llama)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_llama: Path):
    async with (
        running_server(tiny_llama, fake=False, engine={"num_kv_pages": 128}) as (_, target),
        AsyncClient(target) as c,
    ):
        yield c


def assert_scores_equal(scores: pb.PromptLogprobs, prompt: list[int], reference: torch.Tensor):
    start = scores.start
    expected = reference[start - 1 :].gather(-1, torch.tensor(prompt[start:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(list(scores.logprobs)), expected, atol=1e-4, rtol=0)


async def test_started_carries_the_prompt_logprobs_and_top_logprobs(client, prompt, reference):
    c = await client.complete(
        build_request(TEXT, max_tokens=3, temperature=0.0, prompt_logprobs=True, top_logprobs=2)
    )
    scores = c.started.prompt_logprobs
    assert scores.start == 1 and len(scores.logprobs) == len(prompt) - 1
    assert c.prompt_logprobs == list(scores.logprobs)
    assert_scores_equal(scores, prompt, reference)
    assert [list(t.token_ids) for t in scores.top_logprobs] == reference.topk(2).indices.tolist()
    assert len(c.token_ids) == 3 and c.reason == "LENGTH"


async def test_max_tokens_0_scores_a_prompt_without_generating(client, prompt, reference):
    request = build_request(prompt, max_tokens=0, prompt_logprobs=True, prompt_logprobs_start=4)
    events = [e async for e in client.generate(request)]
    assert [e.WhichOneof("event") for e in events] == ["started", "finished"]
    assert_scores_equal(events[0].started.prompt_logprobs, prompt, reference)
    finished = events[1].finished
    assert finished.reason == pb.FINISH_REASON_LENGTH and finished.usage.completion_tokens == 0


async def test_a_scoring_request_on_a_generate_stream(client, prompt, reference):
    requests = [
        build_request(prompt, request_id="scored", max_tokens=0, prompt_logprobs=True),
        build_request(prompt, request_id="generated", max_tokens=2, temperature=0.0),
    ]
    collector = Collector()
    async for event in client.generate_many(requests):
        collector.add(event)
    scored, generated = (
        collector.completions[("scored", 0)],
        collector.completions[("generated", 0)],
    )
    assert_scores_equal(scored.started.prompt_logprobs, prompt, reference)
    assert scored.token_ids == [] and scored.reason == "LENGTH"
    assert len(generated.token_ids) == 2 and generated.prompt_logprobs is None


BAD = [
    (dict(prompt_logprobs=True, prompt_logprobs_start=0), "output.prompt_logprobs_start"),
    (dict(prompt_logprobs=True, prompt_logprobs_start=99), "output.prompt_logprobs_start"),
    (dict(max_tokens=0), "stop.max_tokens"),
    (dict(max_tokens=0, prompt_logprobs=True, n=2), "n"),
]


@pytest.mark.parametrize(("params", "field"), BAD)
async def test_bad_prompt_logprobs_requests_are_refused_naming_the_field(client, params, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(build_request("To be, or not to be", **params))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == [field]


async def test_sampled_logprobs_and_the_support_through_the_service(client, prompt):
    params = dict(
        max_tokens=6, temperature=1.0, top_k=5, seed=1, logprobs=True, top_logprobs=2,
        logprob_mode="SAMPLED", sampling_support=True,
    )  # fmt: skip
    c = await client.complete(build_request(prompt, **params))
    assert len(c.sampling_support) == len(c.token_ids) == 6
    assert all(
        t in s and 1 <= len(s) <= 5 for t, s in zip(c.token_ids, c.sampling_support, strict=True)
    )
    plain = await client.complete(build_request(prompt, **{**params, "logprob_mode": None}))
    assert plain.token_ids == c.token_ids  # the mode changes what is reported, not what is drawn
    # Renormalised over at most 5 kept tokens, each logprob is above the untruncated one.
    assert all(s >= p for s, p in zip(c.logprobs, plain.logprobs, strict=True))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(top_p=0.9, sampling_support=True), "output.sampling_support"),
        (dict(raw_logprobs=True, logprob_mode="SAMPLED"), "output.logprob_mode"),
    ],
)
async def test_unbounded_supports_and_conflicting_modes_are_refused(client, params, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(build_request("To be", **params))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    bad = error_details_pb2.BadRequest()
    assert status is not None and status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == [field]
