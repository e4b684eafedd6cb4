"""KV groups in the page pool and the scheduler: layers grouped by window, each group paged on
its own from one free list; a sliding group gives back the pages outside its window while the
request runs; prefix hits on a mixed model reuse only what every group still holds; nothing
leaks (every page free or cached once every request ends)."""

from __future__ import annotations

import random

import torch

from engine.kv_cache.kv_groups import group_layers
from engine.kv_cache.page_pool import PagePool
from engine.models.base import LayerKV
from engine.scheduling.scheduler import Scheduler
from tests.support.scheduler_builders import (
    PAGE,
    SAMPLED,
    assert_pages_accounted,
    finish,
    held_pages,
    make_grouped_scheduler,
    make_request,
    step,
)

W = 8  # the sliding window of the tests' sliding layers: two pages of PAGE tokens


def _groups_of(req_pages: list[list[int]], scratch: int) -> list[int]:
    return [len([p for p in pages if p != scratch]) for pages in req_pages]


def test_layers_group_by_window_in_chunks_of_the_smallest_class() -> None:
    gpt_oss = group_layers([LayerKV(1, 1, 128 if i % 2 == 0 else None) for i in range(4)])
    assert gpt_oss.windows == (None, 128) and gpt_oss.layers == ((1, 3), (0, 2))
    gemma3 = group_layers([LayerKV(1, 1, None if i % 6 == 5 else 512) for i in range(12)])
    assert gemma3.windows == (None, 512, 512, 512, 512, 512) and gemma3.slots == 2
    assert gemma3.layers[1] == (0, 1) and gemma3.layers[0] == (5, 11)
    assert group_layers([LayerKV(1, 1, 16)] * 3).windows == (16,)


def test_each_layer_views_its_own_shape_and_a_page_id_is_one_groups_memory() -> None:
    # Gemma 4's shape: sliding layers of head_dim 4, global ones of 8 (here with one head).
    layers = [LayerKV(2, 4, 8), LayerKV(1, 8, None), LayerKV(2, 4, 8), LayerKV(1, 8, None)]
    pool = PagePool(5, PAGE, 4, 1, 1, torch.float32, torch.device("cpu"), layers)
    caches = pool.layer_caches()
    assert [tuple(k.shape) for k, _ in caches] == [(6, PAGE, 2, 4), (6, PAGE, 1, 8)] * 2
    # Layers 0 and 1 share storage slot 0: one page id is layer 0's or layer 1's, never both.
    caches[0][0][2].fill_(1.0)
    assert caches[1][0][2].eq(1.0).all() and caches[1][0][3].eq(0.0).all()
    assert caches[2][0][2].eq(0.0).all()  # another slot
    per_page = PagePool.bytes_per_grouped_page(PAGE, layers, torch.float32)
    assert per_page == 2 * 2 * PAGE * 8 * 4 == sum(t[0].nbytes for t in pool.storage)
    pool.copy_page(2, 4)
    assert caches[0][0][4].eq(1.0).all()


def _run_alone(sched: Scheduler, prompt_len: int, decodes: int) -> list[list[int]]:
    """Run one request through its prompt and `decodes` tokens; its held pages per group
    after every step."""
    req = make_request("a", prompt_len)
    req.max_tokens = decodes
    sched.add(req)
    scratch, held = sched.cache.pool.scratch_page, []
    for _ in range(200):
        if req.num_computed_tokens >= prompt_len + decodes:
            break
        step(sched)
        held.append(_groups_of([req.pages, *req.group_pages], scratch))
        assert_pages_accounted(sched)
    assert req.num_computed_tokens >= prompt_len + decodes and not sched.too_big
    finish(sched, req)
    assert_pages_accounted(sched)
    return held


def test_a_long_requests_sliding_group_holds_about_a_window_of_pages() -> None:
    sched = make_grouped_scheduler([W, None], pages=128, budget=16)
    held = _run_alone(sched, prompt_len=100, decodes=40)
    full, sliding = zip(*held, strict=True)
    assert full[-1] == -(-140 // PAGE)  # every page of the full group
    # The window's pages, the one the next query writes to, and those a chunk fills past them.
    assert max(sliding) <= (W - 1 + 16) // PAGE + 2
    assert max(sliding[-10:]) <= W // PAGE + 1  # decoding: a window and the page being filled


def test_an_all_sliding_model_finishes_a_request_longer_than_the_pool() -> None:
    sched = make_grouped_scheduler([W, W], pages=12, budget=8)
    # 30 pages of tokens through a 12-page pool: only the window's pages are ever held.
    held = _run_alone(sched, prompt_len=60, decodes=60)
    assert max(h[0] for h in held) <= (W - 1 + 8) // PAGE + 2


def test_a_prefix_hit_on_a_mixed_model_reuses_pages_every_group_still_holds() -> None:
    sched = make_grouped_scheduler([W, None], budget=64)
    first = make_request("a", 40, seed=1)
    sched.add(first)
    step(sched)
    finish(sched, first)  # its sliding pages below the window were given back, cached
    again = make_request("b", 41, tokens=first.token_ids[:40] + [3])
    sched.add(again)
    batch = sched.schedule()
    assert batch.query_lens == [1] and again.num_computed_tokens == 40
    scratch = sched.cache.pool.scratch_page
    sliding = again.group_pages[0]
    assert sliding[: (40 - W + 1) // PAGE] == [scratch] * ((40 - W + 1) // PAGE)
    assert scratch not in sliding[(40 - W + 1) // PAGE :]
    assert_pages_accounted(sched)


def test_a_hit_stops_where_a_sliding_group_lost_its_window() -> None:
    sched = make_grouped_scheduler([W, None], pages=24, budget=64)
    first = make_request("a", 40, seed=2)
    sched.add(first)
    step(sched)
    finish(sched, first)
    # Evict the cached sliding pages (allocation takes the LRU cached pages once none is free).
    filler = make_request("f", 40, seed=3)
    sched.add(filler)
    step(sched)
    again = make_request("b", 41, tokens=first.token_ids[:40] + [3])
    finish(sched, filler)
    sched.add(again)
    sched.schedule()
    # Whatever it found, every group holds what the next query sees, or nothing was reused.
    done, scratch = again.num_computed_tokens, sched.cache.pool.scratch_page
    assert done % PAGE == 0
    needed = again.group_pages[0][max(0, done - W + 1) // PAGE : done // PAGE]
    assert scratch not in needed and scratch not in again.pages[: done // PAGE]
    assert_pages_accounted(sched)


def test_forks_preemption_and_churn_on_a_mixed_model_leak_no_page() -> None:
    rng = random.Random(5)
    sched = make_grouped_scheduler([W, None, W, None], pages=40, budget=24, max_seqs=4)
    live = []
    for i in range(30):
        req = make_request(f"r{i}", rng.randrange(1, 40), seed=i)
        req.max_tokens = rng.randrange(1, 20)
        sched.add(req)
        live.append(req)
        for _ in range(rng.randrange(1, 4)):
            step(sched)
            for r in list(sched.running):
                if r.num_computed_tokens >= r.prompt_len + r.max_tokens:
                    finish(sched, r)
            assert_pages_accounted(sched)
        for r in list(sched.running):
            if r.num_computed_tokens >= r.prompt_len and rng.random() < 0.3:
                child = make_request(f"{r.request_id}c", 0, tokens=r.token_ids[: r.prompt_len])
                child.max_tokens = 3
                r.pending_forks.append(child)
                sched.fork(child, r)
                if child in sched.running:  # its first token: sampled from its leader's row
                    child.token_ids.append(SAMPLED)
                live.append(child)
                assert_pages_accounted(sched)
    for _ in range(500):
        if not sched.has_work():
            break
        step(sched)
        for r in list(sched.running):
            if r.num_computed_tokens >= r.prompt_len + r.max_tokens:
                finish(sched, r)
    pool = sched.cache.pool
    assert not sched.has_work()
    assert pool.num_free + sched.cache.num_cached == pool.num_pages
    assert all(not held_pages(r, pool.scratch_page) for r in live)


def test_kv_events_describe_the_full_attention_groups_pages_only() -> None:
    sched = make_grouped_scheduler([W, None], budget=64)
    sched.cache.events = []
    req = make_request("a", 40, seed=4)
    sched.add(req)
    step(sched)
    events = sched.cache.take_events() or []
    stored = [h for e in events for h in getattr(e, "block_hashes", [])]
    assert stored == req.page_hashes and len(stored) == 40 // PAGE
    assert sched.cache.page_of_hash == dict(zip(req.page_hashes, req.pages, strict=False))
    # The sliding group's pages are cached too, under the same hashes, without events.
    sliding = sched.cache.indexes[1]
    assert set(sliding) <= set(req.page_hashes) and sliding


def test_pages_given_back_before_they_are_published_are_not_cached() -> None:
    """The overlapped loop schedules step N + 1 (giving pages back) before it publishes step
    N's pages: a given-back entry (the scratch page) is skipped, in group 0 too."""
    sched = make_grouped_scheduler([W, W], budget=64)
    req = make_request("a", 40, seed=6)
    sched.add(req)
    batch = sched.schedule()
    req.num_computed_tokens += batch.query_lens[0]
    req.token_ids.append(SAMPLED)
    sched.schedule()  # gives back the pages below the window, not yet published
    scratch = sched.cache.pool.scratch_page
    assert req.pages[0] == scratch
    cache = sched.cache
    cache.publish(0, req.token_ids, req.pages, 40, req.page_hashes, 0, req.group_pages)
    assert scratch not in cache.hash_of_page
    again = make_request("b", 41, tokens=req.token_ids[:40] + [3])
    finish(sched, req)
    sched.add(again)
    sched.schedule()
    assert again.num_computed_tokens == 40  # the window's pages were published: a hit
    assert_pages_accounted(sched)
