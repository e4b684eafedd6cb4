"""Bad input comes back as that prompt's error; the other prompts run and the engine serves on."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
GOOD_PROMPT = [0, 5, 6, 7]

BAD_INPUTS = {
    "empty prompt": ([], OK, {}, "prompt"),
    "prompt fills the context": ([0] + [5] * 511, OK, {}, "prompt"),
    "token id past the vocabulary": ([0, 5, 10_000], OK, {}, "vocabulary"),
    "negative token id": ([0, -3], OK, {}, "vocabulary"),
    "temperature < 0": (GOOD_PROMPT, SamplingParams(temperature=-0.5), {}, "temperature"),
    "top_p = 0": (GOOD_PROMPT, SamplingParams(top_p=0.0), {}, "top_p"),
    "top_p > 1": (GOOD_PROMPT, SamplingParams(top_p=1.5), {}, "top_p"),
    "top_k < 0": (GOOD_PROMPT, SamplingParams(top_k=-1), {}, "top_k"),
    "min_p > 1": (GOOD_PROMPT, SamplingParams(min_p=2.0), {}, "min_p"),
    "repetition_penalty = 0": (
        GOOD_PROMPT,
        SamplingParams(repetition_penalty=0.0),
        {},
        "repetition_penalty",
    ),
    "max_tokens = 0": (GOOD_PROMPT, SamplingParams(max_tokens=0), {}, "max_tokens"),
    "min_tokens > max_tokens": (
        GOOD_PROMPT,
        SamplingParams(max_tokens=2, min_tokens=3),
        {},
        "min_tokens",
    ),
    "top_logprobs > 20": (GOOD_PROMPT, SamplingParams(top_logprobs=21), {}, "top_logprobs"),
    "stop id past the vocabulary": (
        GOOD_PROMPT,
        SamplingParams(stop_token_ids=(99_999,)),
        {},
        "stop_token_ids",
    ),
    "n = 0": (GOOD_PROMPT, OK, {"n": 0}, "n"),
    "weights older than asked": (GOOD_PROMPT, OK, {"min_policy_version": 3}, "min_policy_version"),
}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_that_requests_error_and_others_run(engine: LLMEngine, case: str) -> None:
    prompt, params, extra, named = BAD_INPUTS[case]
    engine.add_request("good-before", GOOD_PROMPT, OK)
    engine.add_request("bad", prompt, params, **extra)
    engine.add_request("good-after", GOOD_PROMPT, OK)
    finished = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert named in (finished["bad"].error or "")
    assert finished["good-before"].finish_reason == FinishReason.LENGTH
    assert finished["good-after"].finish_reason == FinishReason.LENGTH
    assert engine.pool.num_free + engine.cache.num_cached == engine.pool.num_pages


def test_a_request_id_already_in_flight_is_refused(engine: LLMEngine) -> None:
    engine.add_request("dup", GOOD_PROMPT, OK)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("dup", GOOD_PROMPT, OK)
    engine.abort(["dup"])
    assert engine.step()[0].finish_reason == FinishReason.CANCELLED
