"""Continuous batching: preemption, chunked prefill, priorities, and page accounting."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.protocol.messages import RequestOutput
from tests.support.tiny_models import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", **overrides)
    )


def assert_all_pages_returned(engine: LLMEngine) -> None:
    pool = engine.pool
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert all(count == 0 for count in pool.ref_counts)
    assert len(set(pool.free)) == len(pool.free), "a page is on the free list twice"
    assert pool.num_free + engine.cache.num_cached == pool.num_pages
    assert not set(pool.free) & set(engine.cache.evictable), "a page is both free and cached"


def some_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 300) for _ in range(length + i)] for i in range(count)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preempted_requests_produce_identical_tokens(
    tiny_llama: Path, params: SamplingParams
) -> None:
    prompts = some_prompts(8, 10)
    expected = make_engine(tiny_llama).generate(prompts, params)
    # 8 requests x ~9 pages of 4 tokens need ~72 pages; 14 forces preemption by recompute.
    tight = make_engine(tiny_llama, num_kv_pages=14, page_size=4, enable_prefix_cache=False)
    got = tight.generate(prompts, params)
    assert tight.stats().preemptions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert_all_pages_returned(tight)


def test_chunked_prefill_gives_the_same_tokens(tiny_llama: Path) -> None:
    prompts = some_prompts(4, 60)
    expected = make_engine(tiny_llama).generate(prompts, GREEDY)
    chunked = make_engine(tiny_llama, max_num_batched_tokens=16).generate(prompts, GREEDY)
    assert [r.token_ids for r in chunked] == [r.token_ids for r in expected]


def test_long_prompt_does_not_stall_running_decodes(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "long", "llama", max_position_embeddings=4096)
    engine = make_engine(checkpoint, max_num_batched_tokens=256)
    for i, prompt in enumerate(some_prompts(8, 6)):
        engine.add_request(f"short-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40))
    while any(r.num_output_tokens == 0 for seqs in engine.requests.values() for r in seqs):
        engine.step()
    engine.add_request(
        "long", some_prompts(1, 2000)[0], SamplingParams(temperature=0.0, max_tokens=2)
    )
    long_req = engine.requests["long"][0]
    steps = 0
    while long_req.num_output_tokens == 0:
        outputs = engine.step()
        steps += 1
        advanced = {o.request_id for o in outputs if o.new_token_ids}
        running_short = {rid for rid in engine.requests if rid.startswith("short")}
        assert running_short <= advanced | {o.request_id for o in outputs if o.finished}
    assert steps >= 2000 // 256, "the long prompt should have been split into chunks"


def test_higher_priority_is_admitted_first(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("low", [0, 5, 6], params, priority=0)
    engine.add_request("high", [0, 7, 8], params, priority=5)
    finished = []
    while engine.has_work():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_pending_siblings_keep_their_places_from_later_admissions(tiny_llama: Path) -> None:
    # A leader of n=2 admitted first reserves its sibling's place: the two requests behind it
    # must not both join, or the step ending its prompt samples 4 rows with max_num_seqs 3.
    engine = make_engine(tiny_llama, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("pair", some_prompts(1, 6)[0], params, n=2)
    for k in range(2):
        engine.add_request(f"single-{k}", some_prompts(1, 9, seed=k + 1)[0], params)
    most = 0
    while engine.has_work():
        engine.step()
        reserved = sum(len(r.pending_forks) for r in engine.scheduler.running)
        most = max(most, len(engine.scheduler.running) + reserved)
    assert most == 3
    assert_all_pages_returned(engine)


def test_request_that_cannot_fit_in_the_pool_ends_with_error_alone(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, num_kv_pages=4, page_size=4)
    huge, small = some_prompts(1, 40)[0], [0, 5, 6]
    results = engine.generate([huge, small], SamplingParams(temperature=0.0, max_tokens=4))
    assert results[0].finish_reason == FinishReason.ERROR
    assert results[0].error and "KV pages" in results[0].error
    assert results[1].finish_reason == FinishReason.LENGTH and len(results[1].token_ids) == 4
    assert_all_pages_returned(engine)


def test_randomized_arrivals_aborts_and_priorities_return_every_page(tiny_llama: Path) -> None:
    rng = random.Random(2024)
    engine = make_engine(tiny_llama, num_kv_pages=40, page_size=4, max_num_batched_tokens=64)
    shared_prefix = some_prompts(1, 16, seed=9)[0]
    finished: dict[str, int] = {}
    started = 0
    outputs: list[RequestOutput] = []
    for step in range(300):
        if started < 60 and rng.random() < 0.4:
            tail = some_prompts(1, rng.randrange(1, 30), seed=step)[0][1:]
            prompt = (shared_prefix if rng.random() < 0.5 else [0]) + tail
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.randrange(100),
                max_tokens=rng.randrange(1, 30),
                ignore_eos=True,
            )
            engine.add_request(f"r{started}", prompt, params, priority=rng.randrange(3))
            started += 1
        if engine.requests and rng.random() < 0.1:
            engine.abort([rng.choice(list(engine.requests))])
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
    assert started == 60
    assert finished == {f"r{i}": 1 for i in range(60)}, "each request finishes exactly once"
    assert engine.stats().preemptions > 0
    assert engine.stats().prefix_cache_hits > 0
    assert_all_pages_returned(engine)
