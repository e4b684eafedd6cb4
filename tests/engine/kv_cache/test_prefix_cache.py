"""Prefix caching and parallel sampling (n): shared pages, same outputs, pages accounted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache.page_pool import PagePool
from engine.kv_cache.prefix_cache import PrefixCache

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=40, seed=99, max_tokens=12, ignore_eos=True)


def make_cache(pages: int = 6, page_size: int = 4) -> PrefixCache:
    pool = PagePool(
        pages,
        page_size,
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return PrefixCache(pool)


def fill(cache: PrefixCache, tokens: list[int], version: int = 0) -> list[int]:
    """Allocate pages for tokens, publish them as computed, release them (cached, unreferenced)."""
    pages = [cache.allocate() for _ in range(cache.pool.pages_for(len(tokens)))]
    cache.publish(version, tokens, pages, len(tokens), [])
    for page in pages:
        cache.release(page)
    return pages


def test_published_full_pages_are_found_again_and_shared() -> None:
    cache = make_cache()
    tokens = list(range(10))  # two full pages of 4, one partial
    pages = fill(cache, tokens)
    assert cache.num_cached == 2 and cache.pool.num_free == 4
    hashes: list[int] = []
    hit = cache.match(0, tokens + [99], max_tokens=10, hashes=hashes)
    assert hit == pages[:2] and len(hashes) == 2
    assert [cache.pool.ref_counts[p] for p in hit] == [1, 1] and cache.num_cached == 0


def test_a_hit_needs_equal_tokens_and_the_same_policy_version() -> None:
    cache = make_cache()
    fill(cache, list(range(8)))
    assert cache.match(1, list(range(8)), 8, []) == []  # newer weights: never reused
    assert cache.match(0, [0, 1, 2, 9, 4, 5, 6, 7], 8, []) == []
    # A forged hash collision: the key matches but the page holds other tokens.
    page = cache.page_of_hash[hash((0, (0, 1, 2, 3)))]
    cache.tokens_of_page[page] = (7, 7, 7, 7)
    assert cache.match(0, list(range(8)), 8, []) == []


def test_eviction_takes_the_least_recently_used_unreferenced_page_only_when_nothing_is_free() -> (
    None
):
    cache = make_cache(pages=3, page_size=2)
    old, new = fill(cache, [1, 2]), fill(cache, [3, 4])
    held = cache.match(0, [1, 2], 2, [])  # referenced again: must survive
    assert held == old
    free_page = cache.allocate()  # the one page still on the free list
    assert free_page not in old + new and cache.num_cached == 1
    evicted = cache.allocate()
    assert evicted == new[0]  # the only unreferenced cached page
    assert cache.match(0, [3, 4], 2, []) == []
    assert cache.pool.ref_counts[old[0]] == 1


def test_a_page_matched_by_two_requests_is_cached_again_only_after_both_release_it() -> None:
    cache = make_cache()
    [page] = fill(cache, [1, 2, 3, 4])
    first = cache.match(0, [1, 2, 3, 4, 5], 4, [])
    second = cache.match(0, [1, 2, 3, 4, 6], 4, [])
    assert first == second == [page] and cache.pool.ref_counts[page] == 2
    assert cache.num_cached == 0  # referenced pages are not evictable
    cache.release(page)
    assert cache.num_cached == 0 and cache.pool.ref_counts[page] == 1
    cache.release(page)
    assert cache.num_cached == 1 and page not in cache.pool.free


def test_an_unpublished_page_is_freed_on_its_last_release_not_cached() -> None:
    cache = make_cache()
    page = cache.allocate()
    cache.release(page)
    assert cache.num_cached == 0 and page in cache.pool.free


def test_an_evicted_page_is_forgotten_and_handed_out_with_one_reference() -> None:
    cache = make_cache(pages=1, page_size=2)
    [page] = fill(cache, [1, 2])
    assert cache.num_available == 1
    again = cache.allocate()  # nothing free: the cached page is evicted
    assert again == page and cache.pool.ref_counts[page] == 1
    assert cache.page_of_hash == {} and cache.hash_of_page == {} and cache.tokens_of_page == {}
    cache.release(page)
    assert page in cache.pool.free  # no longer published: freed, not cached


def test_one_adapters_pages_never_serve_another_nor_the_base_model() -> None:
    cache = make_cache()
    tokens = list(range(8))
    pages = [cache.allocate() for _ in range(2)]
    cache.publish(0, tokens, pages, 8, [], adapter=3)
    for page in pages:
        cache.release(page)
    assert cache.match(0, tokens, 8, [], adapter=0) == []
    assert cache.match(0, tokens, 8, [], adapter=4) == []
    assert cache.match(0, tokens, 8, [], adapter=3) == pages


def test_clear_frees_unreferenced_cached_pages_and_forgets_held_ones() -> None:
    cache = make_cache()
    unheld = fill(cache, [1, 2, 3, 4])
    held = fill(cache, [5, 6, 7, 8])
    assert cache.match(0, [5, 6, 7, 8, 9], 4, []) == held
    cache.clear()
    assert unheld[0] in cache.pool.free and cache.num_cached == 0
    assert cache.match(0, [1, 2, 3, 4, 9], 4, []) == []  # nothing is found after a clear
    cache.release(held[0])
    assert held[0] in cache.pool.free  # forgotten: freed on its last release, not cached


def test_a_disabled_cache_neither_publishes_nor_matches() -> None:
    cache = make_cache()
    cache.enabled = False
    pages = [cache.allocate()]
    cache.publish(0, [1, 2, 3, 4], pages, 4, [])
    cache.release(pages[0])
    assert cache.num_cached == 0 and cache.match(0, [1, 2, 3, 4, 5], 4, []) == []


def test_eviction_takes_the_least_recently_released_page_first() -> None:
    cache = make_cache(pages=2, page_size=2)
    [old], [new] = fill(cache, [1, 2]), fill(cache, [3, 4])
    [hit] = cache.match(0, [1, 2, 9], 2, [])  # used again, then released: now the newest
    cache.release(hit)
    assert cache.allocate() == new
    assert cache.match(0, [1, 2, 9], 2, []) == [old]


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> tuple[LLMEngine, LLMEngine]:
    def make(enable: bool) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(tiny_llama),
                device="cpu",
                dtype="float32",
                page_size=8,
                enable_prefix_cache=enable,
            )
        )

    return make(True), make(False)


def groups(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        prefix = [0] + [rng.randrange(2, 300) for _ in range(120)]
        prompts += [
            prefix + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 20))] for _ in range(4)
        ]
    return prompts


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_are_identical_with_the_cache_on_and_off(
    engines: tuple[LLMEngine, LLMEngine], params: SamplingParams
) -> None:
    cached, uncached = engines
    prompts = groups(seed=1)
    on = [cached.generate([p], params)[0] for p in prompts]  # one by one: later ones hit
    off = [uncached.generate([p], params)[0] for p in prompts]
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    for k, result in enumerate(on):
        if k % 4:  # not the first of its group of 4 sharing a 121-token prefix
            assert result.cached_tokens >= 0.9 * 121 - 8  # whole pages of the shared prefix
    assert all(r.cached_tokens == 0 for r in off)


def test_multi_turn_conversation_resending_earlier_turns_hits_and_matches(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    cached = engines[0]
    conversations = {}
    for engine in engines:
        history, replies, hits = [0, 5, 6, 7, 8], [], []
        for turn in range(4):
            history = history + [20 + turn] * 10
            result = engine.generate([history], GREEDY)[0]
            replies.append(result.token_ids)
            hits.append(result.cached_tokens)
            history = history + result.token_ids
        conversations[engine is cached] = (replies, hits)
    assert conversations[True][0] == conversations[False][0]
    assert all(h > 0 for h in conversations[True][1][1:])


def test_n_samples_compute_the_prompt_once(engines: tuple[LLMEngine, LLMEngine]) -> None:
    for engine in engines:
        prompt = [0] + list(range(40, 77))  # 38 tokens: 4 full pages of 8 and a partial one
        before = engine.stats().prompt_tokens_computed
        greedy = engine.generate([prompt], GREEDY, n=8)
        assert engine.stats().prompt_tokens_computed - before <= len(prompt)
        assert [r.index for r in greedy] == list(range(8))
        single = engine.generate([prompt], GREEDY)[0].token_ids
        assert all(r.token_ids == single for r in greedy)
        seeded = engine.generate([prompt], SEEDED, n=8)
        assert len({tuple(r.token_ids) for r in seeded}) == 8
        again = engine.generate([prompt], SEEDED, n=8)
        assert [r.token_ids for r in again] == [r.token_ids for r in seeded]
        # Sample i of a seeded request is the request with seed + i.
        third = SamplingParams(**{**SEEDED.__dict__, "seed": SEEDED.seed + 3})
        assert engine.generate([prompt], third)[0].token_ids == seeded[3].token_ids


def test_stress_with_hits_n_aborts_and_preemption_accounts_for_every_page(tiny_llama: Path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama),
            device="cpu",
            dtype="float32",
            page_size=4,
            num_kv_pages=48,
            max_num_batched_tokens=48,
        )
    )
    rng = random.Random(7)
    prefixes = [[0] + [rng.randrange(2, 300) for _ in range(20)] for _ in range(3)]
    ended: dict[tuple[str, int], int] = {}
    expected: set[tuple[str, int]] = set()
    for step in range(400):
        if step < 250 and rng.random() < 0.35:
            n = rng.choice([1, 1, 2, 4])
            prompt = rng.choice(prefixes) + [
                rng.randrange(2, 300) for _ in range(rng.randrange(1, 12))
            ]
            params = SamplingParams(
                temperature=rng.choice([0.0, 1.0]),
                seed=step,
                max_tokens=rng.randrange(1, 20),
                ignore_eos=True,
            )
            engine.add_request(f"s{step}", prompt, params, n=n)
            expected |= {(f"s{step}", i) for i in range(n)}
        if engine.requests and rng.random() < 0.08:
            index = rng.choice([None, 0, 1])
            engine.abort([rng.choice(list(engine.requests))], index=index)
        for out in engine.step():
            if out.finished:
                ended[(out.request_id, out.index)] = ended.get((out.request_id, out.index), 0) + 1
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                ended[(out.request_id, out.index)] = ended.get((out.request_id, out.index), 0) + 1
    assert ended == dict.fromkeys(expected, 1)
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.preemptions > 0
    pool = engine.pool
    assert all(c == 0 for c in pool.ref_counts)
    assert len(set(pool.free)) == len(pool.free)
    assert stats.free_pages + stats.cached_pages == stats.total_pages
