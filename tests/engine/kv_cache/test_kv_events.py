"""The prefix cache's events: what it publishes, forgets and clears, as it happens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache.prefix_cache import PrefixCache
from engine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from tests.engine.kv_cache.test_prefix_cache import fill, make_cache

PAGE = 4


def recording(pages: int = 6) -> PrefixCache:
    cache = make_cache(pages=pages, page_size=PAGE)
    cache.events = []
    return cache


def stored_blocks(events: list[KvEvent]) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """(hash, parent hash, tokens) of every stored page, in order."""
    blocks = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_hash
            for key, tokens in zip(event.block_hashes, event.token_ids, strict=True):
                blocks.append((key, parent, tokens))
                parent = key
    return blocks


def test_a_prompts_full_pages_are_stored_with_their_tokens_and_the_caches_chain() -> None:
    cache = recording()
    tokens = list(range(100, 111))  # two full pages of 4, one partial
    pages = fill(cache, tokens)
    events = cache.take_events()
    assert events is not None and len(events) == 1  # one chain: one event
    blocks = stored_blocks(events)
    assert [b[2] for b in blocks] == [tuple(tokens[0:4]), tuple(tokens[4:8])]
    # The hashes are the cache's own keys, chained as the cache chains them.
    assert [b[0] for b in blocks] == [cache.hash_of_page[p] for p in pages[:2]]
    assert blocks[0][1] is None and blocks[1][1] == blocks[0][0]
    assert all(-(2**63) <= b[0] < 2**63 for b in blocks)  # the proto's int64
    assert cache.take_events() is None  # taken once


def test_a_continuation_chains_to_the_page_before_it() -> None:
    cache = recording()
    tokens = list(range(12))
    pages = [cache.allocate() for _ in range(3)]
    hashes: list[int] = []
    cache.publish(0, tokens, pages, 4, hashes)  # the first page computed
    cache.publish(0, tokens, pages, 12, hashes)  # then the other two
    first, rest = cache.take_events() or []
    assert isinstance(first, BlockStored) and isinstance(rest, BlockStored)
    assert rest.parent_hash == first.block_hashes[0] == hashes[0]
    assert rest.block_hashes == hashes[1:] and rest.token_ids == [(4, 5, 6, 7), (8, 9, 10, 11)]


def test_eviction_removes_exactly_the_evicted_hashes() -> None:
    cache = recording(pages=4)
    fill(cache, list(range(8)))  # two cached pages, two free
    fill(cache, list(range(50, 58)))  # the two free ones: nothing evicted yet
    cache.take_events()
    lru = [cache.hash_of_page[p] for p in list(cache.evictable)[:3]]
    for _ in range(3):  # the free list is empty: each allocation evicts the LRU page
        cache.allocate()
    assert cache.take_events() == [BlockRemoved(lru)]
    assert all(key not in cache.page_of_hash for key in lru)


def test_a_page_already_published_is_not_stored_again() -> None:
    cache = recording()
    tokens = list(range(8))
    fill(cache, tokens)
    cache.take_events()
    hashes: list[int] = []
    hit = cache.match(0, tokens, 8, hashes)
    cache.publish(0, tokens, hit, 8, hashes)
    assert cache.take_events() is None


def test_clear_is_all_blocks_cleared_after_what_came_before() -> None:
    cache = recording()
    fill(cache, list(range(4)))
    cache.clear()
    events = cache.take_events() or []
    assert [type(e) for e in events] == [BlockStored, AllBlocksCleared]


def test_a_cache_nobody_reads_records_nothing() -> None:
    cache = make_cache(page_size=PAGE)
    fill(cache, list(range(8)))
    cache.clear()
    assert cache.events is None and cache.take_events() is None


# ---- the engine: weight updates, sleep, flush ----

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 40))  # two full pages of 16 and a partial one


@pytest.fixture
def engine(tiny_llama: Path) -> LLMEngine:
    config = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", num_kv_pages=64)
    engine = LLMEngine(config)
    engine.cache.events = []  # as the engine process does after the warm-up
    return engine


def test_a_generated_prompt_stores_its_pages_as_the_engine_cached_them(engine: LLMEngine) -> None:
    engine.generate([PROMPT], GREEDY)
    blocks = stored_blocks(engine.cache.take_events() or [])
    size = engine.pool.page_size
    assert [b[2] for b in blocks] == [tuple(PROMPT[i : i + size]) for i in (0, size)]
    # The engine matches a second request against exactly these hashes.
    hashes: list[int] = []
    hit = engine.cache.match(engine.policy_version, PROMPT, len(PROMPT), hashes)
    assert [b[0] for b in blocks] == hashes and len(hit) == 2
    for page in hit:
        engine.cache.release(page)


def test_a_weight_update_clears_every_block(engine: LLMEngine, tiny_llama: Path) -> None:
    engine.generate([PROMPT], GREEDY)
    engine.cache.take_events()
    engine.update_weights(tiny_llama, policy_version=engine.policy_version + 1)
    assert AllBlocksCleared() in (engine.cache.take_events() or [])


def test_a_sleep_clears_every_block(engine: LLMEngine) -> None:
    engine.generate([PROMPT], GREEDY)
    engine.cache.take_events()
    engine.sleep(level=1)
    assert (engine.cache.take_events() or [])[-1] == AllBlocksCleared()


def test_a_flush_keeps_requests_running_and_clears_every_block(engine: LLMEngine) -> None:
    engine.generate([PROMPT], GREEDY)
    cached = engine.stats().cached_pages
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("running", PROMPT[:20], params)
    engine.step()  # its prompt: the first page is a hit, the rest computed
    engine.cache.take_events()
    assert engine.flush_cache() == cached - 1  # the running request holds the hit page
    assert engine.cache.take_events() == [AllBlocksCleared()]
    assert not engine.cache.page_of_hash and engine.stats().cached_pages == 0
    outputs = [o for _ in range(60) if engine.has_work() for o in engine.step()]
    assert sum(len(o.new_token_ids) for o in outputs) == 39  # it ran to its end
    # Its later pages (computed with KV from before the flush) were never published.
    assert engine.cache.take_events() is None and not engine.cache.page_of_hash
