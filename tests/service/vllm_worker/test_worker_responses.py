"""WorkerResponses on its own: a sample's sluice.v1 Usage becomes the worker protocol's
GenerateComplete counts, speculative decoding's included (spec_draft_tokens: the proposed ones)."""

from __future__ import annotations

from sluice.v1 import generation_pb2 as pb

from service.vllm_worker.request_mapping import LogprobCounts
from service.vllm_worker.responses import WorkerResponses


def test_the_usage_and_its_speculative_counts_reach_generate_complete() -> None:
    responses = WorkerResponses(
        stream=True,
        counts=LogprobCounts(None, None),
        prompt_token_ids=[0, 5],
        stop_token_ids=frozenset(),
    )
    usage = pb.Usage(
        prompt_tokens=2, completion_tokens=9, cached_tokens=1, proposed_tokens=12, accepted_tokens=7
    )
    events = [
        pb.GenerateResponse(started=pb.Started(prompt_tokens=2, cached_tokens=1)),
        pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[5] * 9)),
        pb.GenerateResponse(finished=pb.Finished(reason=pb.FINISH_REASON_LENGTH, usage=usage)),
    ]
    *_, last = [response for event in events for response in responses.absorb(event)]
    complete = last.complete
    assert complete.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens, complete.cached_tokens) == (2, 9, 1)
    assert (complete.spec_draft_tokens, complete.spec_accepted_tokens) == (12, 7)
