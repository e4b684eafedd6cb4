"""The pipe's messages survive the pipe: what the engine pickles, the service gets back."""

from __future__ import annotations

import pickle
from dataclasses import fields

from engine.protocol.messages import FinishReason, PromptLogprobs, RequestMetrics, RequestOutput


def test_a_request_output_with_every_field_set_round_trips():
    output = RequestOutput(
        request_id="r-1",
        index=2,
        new_token_ids=[5, 6],
        policy_version=7,
        logprobs=[-0.5, -1.5],
        top_logprobs=[([5, 9], [-0.5, -2.0]), ([6, 1], [-1.5, -1.75])],
        finish_reason=FinishReason.ERROR,
        error="boom",
        prompt_tokens=11,
        cached_tokens=3,
        completion_tokens=13,
        metrics=RequestMetrics(queue_time=0.25, time_to_first_token=0.5, decode_time=1.0),
        prompt_logprobs=PromptLogprobs(1, [-2.5, -3.5], [([4], [-2.5]), ([8], [-0.25])]),
        sampling_support=[[5, 9, 2], [6]],
        routed_experts=[[0, 3], [1, 2]],
        spec_tokens=(17, 19),
    )
    # Distinct values everywhere: a field restored into its neighbour's place shows.
    assert len({repr(getattr(output, f.name)) for f in fields(output)}) == len(fields(output))
    copy = pickle.loads(pickle.dumps(output))
    assert copy == output
    assert copy.finished


def test_defaults_round_trip():
    output = RequestOutput("r", 0, [1], 0)
    assert pickle.loads(pickle.dumps(output)) == output
