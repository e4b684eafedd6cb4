"""Preemption: when a running request needs a page and none is available, the newest running
request gives its pages back and waits to recompute, keeping its tokens and its place by
priority and arrival; the request that needed the page may be that newest one itself.

A Scheduler over a small page pool, no model (tests/support/scheduler_builders.py).
"""

from __future__ import annotations

from engine.scheduling.request import RequestStatus
from tests.support.scheduler_builders import (
    PAGE,
    assert_pages_accounted,
    finish,
    make_request,
    make_scheduler,
    step,
)


def test_the_newest_running_request_is_preempted_for_an_older_ones_page() -> None:
    sched = make_scheduler(pages=6, budget=64, prefix_cache=False)
    a, b, c = (make_request(name, 2 * PAGE, seed=i) for i, name in enumerate("abc"))
    for req in (a, b, c):
        sched.add(req)
    step(sched)  # three prompts of two full pages: the pool is full
    tokens = list(c.token_ids)
    batch = step(sched)  # every decode starts a third page: c, the newest, makes room
    assert batch.requests == [a, b]
    assert c.status is RequestStatus.WAITING and sched.waiting == [c]
    assert c.pages == [] and c.slot is None and c.num_computed_tokens == 0
    assert c.token_ids == tokens  # its prompt and its sampled token are kept
    assert sched.num_preemptions == 1
    assert [len(a.pages), len(b.pages)] == [3, 3]
    assert_pages_accounted(sched)


def test_the_newest_request_needing_a_page_preempts_itself() -> None:
    sched = make_scheduler(pages=4, budget=64, prefix_cache=False)
    older = make_request("older", PAGE + 2, seed=0)  # 2 pages, room to grow to 8 tokens
    newest = make_request("newest", 2 * PAGE, seed=1)  # 2 full pages
    sched.add(older)
    sched.add(newest)
    step(sched)
    batch = step(sched)
    assert batch.requests == [older]
    assert newest.status is RequestStatus.WAITING and newest.pages == []
    assert_pages_accounted(sched)


def test_a_preempted_request_keeps_its_place_and_recomputes_all_its_tokens() -> None:
    sched = make_scheduler(pages=6, budget=64, prefix_cache=False)
    a, b, c = (make_request(name, 2 * PAGE, seed=i) for i, name in enumerate("abc"))
    for req in (a, b, c):
        sched.add(req)
    step(sched)
    later = make_request("later", 3, seed=10)  # arrives after c
    sched.add(later)
    step(sched)  # preempts c
    assert sched.waiting == [c, later]  # c's arrival still comes first
    finish(sched, a)
    finish(sched, b)
    batch = step(sched)
    # Its 8 prompt tokens and the one it had sampled, computed again in one go.
    assert batch.requests[0] is c and batch.query_lens[0] == 2 * PAGE + 1
    assert c.num_cached_tokens == 0 and sched.running == [c, later]
    assert_pages_accounted(sched)


def test_a_preempted_request_finds_its_published_pages_again() -> None:
    sched = make_scheduler(pages=9, budget=64)  # a and b grow, and c has a page to resume
    a, b, c = (make_request(name, 2 * PAGE, seed=i) for i, name in enumerate("abc"))
    for req in (a, b, c):
        sched.add(req)
    step(sched)
    cached_pages = list(c.pages)
    hits = sched.prefix_hits
    sched.preempt(c)
    assert sched.cache.num_cached == 2  # its full, published pages stay cached
    batch = step(sched)
    # Its whole prompt comes back from the cache: only its sampled token is computed.
    assert batch.requests[-1] is c and batch.query_lens[-1] == 1
    assert c.pages[:2] == cached_pages and len(c.pages) == 3
    # A resume is not a new request: the hit ratio counts first admissions only.
    assert sched.prefix_hits == hits and c.num_cached_tokens == 0
    assert_pages_accounted(sched)
