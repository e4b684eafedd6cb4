"""Verifying drafts gives every request exactly what decoding without them gives: tokens,
logprobs, finish reasons and counts, greedy and sampled, whatever the proposals are."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from engine import FinishReason, SamplingParams
from tests.support.overlap_runs import Request, assert_all_pages_returned, make_engine, run
from tests.support.spec_runs import ReplayProposer, assert_same, compare, spec_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=16, ignore_eos=True, logprobs=True
)


def some_requests(params: SamplingParams, count: int = 5, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    prompts = [[0] + [rng.randrange(2, 300) for _ in range(6 + 3 * i)] for i in range(count)]
    return [
        Request(f"r{i}", p, replace(params, max_tokens=6 + 4 * i)) for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_tokens_and_logprobs_equal_decoding_without_speculation(
    tiny_llama: Path, params: SamplingParams, wrong: float
) -> None:
    requests = some_requests(params)
    plain = run(make_engine(tiny_llama, False), requests)
    proposer = ReplayProposer(plain, wrong)
    engine = spec_engine(tiny_llama, proposer)
    spec = run(engine, requests)
    assert_same(spec, plain)
    assert {s.finish_reason for s in plain.values()} == {FinishReason.LENGTH}
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 0
    if wrong == 0.0:  # every proposal is right: all kept, fewer steps than tokens
        assert stats.spec_accepted_tokens == stats.spec_proposed_tokens
    assert sorted(proposer.ended) == sorted(plain)
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_overlapped_loop_verifies_the_same_tokens(
    tiny_llama: Path, params: SamplingParams
) -> None:
    plain, spec, engine = compare(tiny_llama, some_requests(params), overlap=True)
    assert engine.overlap is not None
    assert_same(spec, plain)
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunked_prefill_and_a_step_budget_that_cuts_drafts(
    tiny_llama: Path, params: SamplingParams
) -> None:
    reqs = some_requests(params, count=4)
    reqs += [Request("long", [0] + list(range(5, 45)), replace(params, max_tokens=12))]
    plain, spec, engine = compare(tiny_llama, reqs, max_num_batched_tokens=8)
    assert_same(spec, plain)
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_in_a_tiny_pool(tiny_llama: Path, params: SamplingParams) -> None:
    tight = {"num_kv_pages": 14, "page_size": 4, "enable_prefix_cache": False}
    plain, spec, engine = compare(tiny_llama, some_requests(params, count=8), **tight)
    assert engine.stats().preemptions > 0
    assert_same(spec, plain)
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_n_above_one(tiny_llama: Path, params: SamplingParams) -> None:
    reqs = [replace(r, n=3) for r in some_requests(params, count=3)]
    plain, spec, engine = compare(tiny_llama, reqs, page_size=4)
    assert len(plain) == 9
    assert_same(spec, plain)
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_stop_ids_end_each_request_at_the_same_token(
    tiny_llama: Path, params: SamplingParams
) -> None:
    free = run(make_engine(tiny_llama, False), some_requests(params))
    stopping = []
    for i, (r, s) in enumerate(zip(some_requests(params), free.values(), strict=True)):
        stop = s.token_ids[min(2 + i, len(s.token_ids) - 1)]
        stopping.append(replace(r, params=replace(r.params, stop_token_ids=(stop,))))
    plain, spec, engine = compare(tiny_llama, stopping, wrong=0.0)
    assert FinishReason.STOP in {s.finish_reason for s in plain.values()}
    assert_same(spec, plain)
    assert_all_pages_returned(engine)


def test_prefix_cache_hits_on_pages_a_verified_request_published(tiny_llama: Path) -> None:
    prompt = [0] + list(range(7, 47))

    def then_again(engine, out, seen) -> None:  # type: ignore[no-untyped-def]
        if out.request_id == "first" and out.finished:
            engine.add_request("second", prompt + seen[("first", 0)].token_ids[:9], GREEDY)

    reqs = [Request("first", prompt, replace(GREEDY, max_tokens=24))]
    plain, spec, engine = compare(tiny_llama, reqs, then_again, page_size=4)
    assert plain[("second", 0)].cached_tokens >= 44  # the prompt and generated tokens
    assert_same(spec, plain)
    assert_all_pages_returned(engine)
