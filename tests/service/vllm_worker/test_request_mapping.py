"""request_mapping on its own: the worker protocol's proto3 zeros read as vLLM's servicer reads
them, and its logprob counts shared out over sluice.v1's one top_logprobs."""

from __future__ import annotations

from sluice.v1 import generation_pb2 as pb

from service.vllm_worker.pb import vllm_engine_pb2 as vpb
from service.vllm_worker.request_mapping import to_sluice


def mapped(**params) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
    return to_sluice(vpb.GenerateRequest(text="hi", sampling_params=vpb.SamplingParams(**params)))


def test_proto3_zeros_are_unset() -> None:
    request = mapped()
    for field in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        assert not request.sampling.HasField(field), field
    assert not request.HasField("n") and not request.stop.HasField("max_tokens")
    assert not request.output.logprobs and not request.output.prompt_logprobs
    assert not request.HasField("structured")


def test_set_values_carry_over() -> None:
    request = mapped(
        temperature=0.0, top_p=0.5, top_k=7, repetition_penalty=1.2, n=3, max_tokens=9, seed=-1
    )
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert (request.sampling.top_p, request.sampling.top_k, request.n) == (0.5, 7, 3)
    assert request.stop.max_tokens == 9
    assert request.sampling.seed == 2**64 - 1  # int32 -1 as its two's complement


def test_logprob_counts_share_one_top_logprobs_and_take_raw_logprobs() -> None:
    request = mapped(logprobs=2, prompt_logprobs=5)
    assert request.output.logprobs and request.output.prompt_logprobs
    assert request.output.top_logprobs == 5
    assert request.output.logprob_mode == pb.LOGPROB_MODE_RAW
    only_the_token = mapped(logprobs=0).output
    assert only_the_token.logprobs and only_the_token.top_logprobs == 0


def test_a_choice_constraint_becomes_sluices() -> None:
    request = mapped(choice=vpb.ChoiceConstraint(choices=["yes", "no"]))
    assert list(request.structured.choice.choices) == ["yes", "no"]
