"""Degenerate sampling values: tiny temperatures are greedy, extremes stay finite, inf/NaN refused."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.protocol.generation_result import GenerationResult

PROMPT = [0, 17, 42, 99, 123, 7, 88]
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
BASE = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=5, seed=7)

# The edges of what SamplingParams accepts, alone and combined (the smallest sampled
# temperature multiplies whatever the penalties did to the logits).
EXTREMES = {
    "smallest sampled temperature": {"temperature": 1e-5},
    "largest temperature": {"temperature": 3.4028234663852886e38},
    "smallest top_p": {"top_p": 5e-324},
    "min_p 1": {"min_p": 1.0},
    "penalties +2": {"frequency_penalty": 2.0, "presence_penalty": 2.0},
    "penalties -2": {"frequency_penalty": -2.0, "presence_penalty": -2.0},
    "smallest repetition penalty": {"repetition_penalty": 0.001, "temperature": 1e-5},
    "largest repetition penalty": {"repetition_penalty": 1000.0, "temperature": 1e-5},
    "greedy, largest repetition penalty": {"repetition_penalty": 1000.0, "temperature": 0.0},
}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))


def assert_sane(engine: LLMEngine, result: GenerationResult) -> None:
    vocab = engine.model_config.vocab_size
    assert result.finish_reason == FinishReason.LENGTH, result.error
    assert len(result.token_ids) == 12 and all(0 <= t < vocab for t in result.token_ids)
    assert result.logprobs is not None and result.top_logprobs is not None
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in result.logprobs)
    assert all(math.isfinite(lp) for _, lps in result.top_logprobs for lp in lps)


@pytest.mark.parametrize("temperature", [1e-37, 1e-6, 9.9e-6])
def test_a_tiny_temperature_is_greedy_with_the_logprobs_of_temperature_0(
    engine: LLMEngine, temperature: float
) -> None:
    greedy = engine.generate([PROMPT], replace(BASE, temperature=0.0))[0]
    tiny = replace(BASE, temperature=temperature)
    sampled = replace(BASE, temperature=1.0)
    # Alone (an all-greedy batch) and beside a sampled row (the per-row path).
    for result in (
        engine.generate([PROMPT], tiny)[0],
        engine.generate([PROMPT, PROMPT], [tiny, sampled])[0],
    ):
        assert_sane(engine, result)
        assert result.token_ids == greedy.token_ids
        assert result.logprobs == pytest.approx(greedy.logprobs, abs=1e-5)
        pairs = zip(result.top_logprobs or [], greedy.top_logprobs or [], strict=True)
        for (ids, lps), (greedy_ids, greedy_lps) in pairs:
            assert ids == greedy_ids and lps == pytest.approx(greedy_lps, abs=1e-5)


def test_the_greedy_threshold_is_one_rule() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=9.99e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("case", sorted(EXTREMES))
def test_extreme_accepted_values_give_finite_logprobs_and_real_ids(
    engine: LLMEngine, case: str
) -> None:
    params = replace(BASE, **EXTREMES[case])
    assert params.errors() == []
    assert_sane(engine, engine.generate([PROMPT], params)[0])
    raw = replace(params, raw_logprobs=True)
    assert_sane(engine, engine.generate([PROMPT], raw)[0])


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e39])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_a_non_finite_float_is_refused_naming_its_field(name: str, value: float) -> None:
    # 1e39 is finite in Python but inf in the engine's float32 tensors.
    errors = replace(BASE, **{name: value}).errors()
    assert [field for field, _ in errors] == [name]


@pytest.mark.parametrize("value", [0.0, 1e-40, 0.0009, 1001.0])
def test_a_repetition_penalty_that_could_overflow_the_logits_is_refused(value: float) -> None:
    errors = replace(BASE, repetition_penalty=value, temperature=1e-5).errors()
    assert [field for field, _ in errors] == ["repetition_penalty"]


def test_the_engine_ends_each_non_finite_request_with_an_error_naming_the_field(
    engine: LLMEngine,
) -> None:
    cases = {
        f"{name}={value}": replace(BASE, **{name: value})
        for name in FLOAT_FIELDS
        for value in (math.inf, -math.inf, math.nan)
    }
    for request_id, params in cases.items():
        engine.add_request(request_id, PROMPT, params)
    engine.add_request("good", PROMPT, BASE)
    finished = {}
    while engine.has_work():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    for request_id in cases:
        name = request_id.split("=")[0]
        out = finished[request_id]
        assert out.finish_reason == FinishReason.ERROR and not out.new_token_ids
        assert (out.error or "").startswith(f"{name}: "), out.error
    assert finished["good"].finish_reason == FinishReason.LENGTH
