"""Prompt logprobs: every scored prompt position equals HF's log-softmax of the same prompt,
whatever computes the prompt (one step or chunks, a prefix-cache hit, the overlapped loop, a
preemption), for n > 1 and for a scoring-only request (max_tokens 0)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import FinishReason, GenerationResult, LLMEngine, SamplingParams
from tests.support.overlap_runs import assert_all_pages_returned, make_engine
from tests.support.tiny_models import load_hf_model

SCORE = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=True)


@pytest.fixture(scope="module")
def hf(tiny_llama: Path):  # type: ignore[no-untyped-def]
    return load_hf_model(tiny_llama)


def a_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, 300) for _ in range(length - 1)]


def hf_scores(hf, prompt: list[int], temperature: float = 1.0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[len(prompt), vocab]: row p is the log-softmax that scores prompt token p (row 0 unused)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float() / temperature
    return torch.cat([torch.zeros_like(logits[:1]), torch.log_softmax(logits[:-1], dim=-1)])


def assert_equal_to_hf(result: GenerationResult, reference: torch.Tensor, start: int) -> None:
    scores = result.prompt_logprobs
    assert scores is not None and scores.start == start
    prompt = result.prompt_token_ids
    expected = reference[start:].gather(-1, torch.tensor(prompt[start:])[:, None])[:, 0]
    assert len(scores.logprobs) == len(prompt) - start
    torch.testing.assert_close(torch.tensor(scores.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_prompt_logprobs_equal_hf_from_position_1(tiny_llama: Path, hf, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama, overlap)
    prompt = a_prompt(37)
    result = engine.generate([prompt], replace(SCORE, top_logprobs=3))[0]
    reference = hf_scores(hf, prompt)
    assert_equal_to_hf(result, reference, 1)
    assert result.prompt_logprobs is not None and result.prompt_logprobs.top_logprobs is not None
    top = result.prompt_logprobs.top_logprobs
    assert [ids for ids, _ in top] == reference[1:].topk(3, dim=-1).indices.tolist()
    torch.testing.assert_close(
        torch.tensor([lps for _, lps in top]), reference[1:].topk(3).values, atol=1e-4, rtol=0
    )
    assert len(result.token_ids) == 4  # the generated tokens are unaffected
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_chunked_prefill_scores_every_chunk(tiny_llama: Path, hf, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama, overlap, max_num_batched_tokens=16)
    prompts = [a_prompt(45, seed) for seed in range(3)]
    results = engine.generate(prompts, replace(SCORE, prompt_logprobs_start=5))
    for prompt, result in zip(prompts, results, strict=True):
        assert_equal_to_hf(result, hf_scores(hf, prompt), 5)


def test_a_cached_prefix_does_not_hide_the_positions_asked_for(tiny_llama: Path, hf) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama, False, page_size=4)
    prompt = a_prompt(30)
    reference = hf_scores(hf, prompt)
    engine.generate([prompt], replace(SCORE, prompt_logprobs=False))  # caches the prompt pages
    for start in (1, 10, 29):
        result = engine.generate([prompt], replace(SCORE, prompt_logprobs_start=start))[0]
        assert_equal_to_hf(result, reference, start)
        # Only whole pages before position start - 1 come from the cache.
        assert result.cached_tokens == (start - 1) // 4 * 4
    plain = engine.generate([prompt], replace(SCORE, prompt_logprobs=False))[0]
    assert plain.cached_tokens == 28  # the cache still serves requests that score nothing


def test_temperature_divides_the_logits_and_raw_logprobs_do_not(tiny_llama: Path, hf) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama, False)
    prompt = a_prompt(20)
    hot = replace(SCORE, temperature=0.5, seed=1)
    assert_equal_to_hf(engine.generate([prompt], hot)[0], hf_scores(hf, prompt, 0.5), 1)
    raw = replace(hot, raw_logprobs=True)
    assert_equal_to_hf(engine.generate([prompt], raw)[0], hf_scores(hf, prompt), 1)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_n_samples_share_one_scoring_of_the_prompt(tiny_llama: Path, hf, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama, overlap)
    prompt = a_prompt(26)
    params = replace(SCORE, temperature=1.0, seed=5)
    results = engine.generate([prompt], params, n=3)
    assert_equal_to_hf(results[0], hf_scores(hf, prompt, 1.0), 1)
    assert [r.prompt_logprobs for r in results[1:]] == [None, None]
    assert all(len(r.token_ids) == 4 for r in results)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_max_tokens_0_scores_the_prompt_and_generates_nothing(
    tiny_llama: Path,
    hf,  # type: ignore[no-untyped-def]
    overlap: bool,
) -> None:
    engine = make_engine(tiny_llama, overlap, max_num_batched_tokens=16)
    prompts = [a_prompt(40, seed) for seed in range(2)] + [a_prompt(5, 9)]
    score_only = replace(SCORE, max_tokens=0)
    mixed = [score_only, replace(score_only, prompt_logprobs_start=40), SCORE]
    results = engine.generate(prompts, mixed)
    assert_equal_to_hf(results[0], hf_scores(hf, prompts[0]), 1)
    assert results[1].prompt_logprobs is not None and results[1].prompt_logprobs.logprobs == []
    for result in results[:2]:
        assert result.token_ids == [] and result.finish_reason is FinishReason.LENGTH
        assert result.completion_tokens == 0
    assert len(results[2].token_ids) == 4  # batched with them, unaffected
    assert_equal_to_hf(results[2], hf_scores(hf, prompts[2]), 1)
    assert_all_pages_returned(engine)


def test_a_preempted_prompt_is_scored_in_full(tiny_llama: Path, hf) -> None:  # type: ignore[no-untyped-def]
    tight = {"num_kv_pages": 14, "page_size": 4, "max_num_batched_tokens": 8}
    engine = make_engine(tiny_llama, False, **tight)
    prompts = [a_prompt(18, seed) for seed in range(5)]
    results = engine.generate(prompts, replace(SCORE, max_tokens=10))
    assert engine.stats().preemptions > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert_equal_to_hf(result, hf_scores(hf, prompt), 1)


@pytest.mark.parametrize(
    ("params", "n", "error"),
    [
        (replace(SCORE, prompt_logprobs_start=0), 1, "prompt_logprobs_start: must be >= 1"),
        (replace(SCORE, prompt_logprobs_start=9), 1, "prompt_logprobs_start: must be at most"),
        (replace(SCORE, prompt_logprobs=False, max_tokens=0), 1, "max_tokens: must be >= 1"),
        (replace(SCORE, max_tokens=0), 2, "n: must be 1 to score a prompt"),
    ],
)
def test_bad_prompt_logprobs_requests_end_with_an_error(
    tiny_llama: Path, params: SamplingParams, n: int, error: str
) -> None:
    engine: LLMEngine = make_engine(tiny_llama, False)
    results = engine.generate([a_prompt(8)], params, n=n)
    assert {r.finish_reason for r in results} == {FinishReason.ERROR}
    assert all(r.error is not None and error in r.error for r in results)
    ok = engine.generate([a_prompt(8)], SCORE)[0]  # the engine goes on
    assert ok.finish_reason is FinishReason.LENGTH
