"""Freeing on finish and abort: a request taken out of the scheduler, running, waiting or a
pending fork, gives back every page it holds; a page shared by siblings stays while one holds
it; full published pages stay cached for reuse; and churn of arrivals, finishes, aborts and
preemptions leaks no page.

A Scheduler over a small page pool, no model (tests/support/scheduler_builders.py).
"""

from __future__ import annotations

import random

from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import Scheduler
from tests.support.scheduler_builders import (
    PAGE,
    assert_pages_accounted,
    finish,
    make_request,
    make_scheduler,
    step,
)


def test_a_finished_request_returns_its_pages_to_the_free_list() -> None:
    sched = make_scheduler(pages=8, prefix_cache=False)
    req = make_request("r", 10)
    sched.add(req)
    step(sched)
    assert sched.cache.pool.num_free == 5
    finish(sched, req)
    assert req.pages == [] and req.slot is None
    assert sched.cache.pool.num_free == 8 and not sched.has_work()
    assert_pages_accounted(sched)


def test_a_finished_requests_full_pages_stay_cached_and_its_partial_page_is_freed() -> None:
    sched = make_scheduler(pages=8)
    req = make_request("r", 2 * PAGE + 2)  # two full pages and a partial one
    sched.add(req)
    step(sched)
    finish(sched, req)
    assert sched.cache.num_cached == 2 and sched.cache.pool.num_free == 6
    assert_pages_accounted(sched)


def test_an_aborted_waiting_request_leaves_the_queue() -> None:
    sched = make_scheduler(max_seqs=1)
    running, waiting = make_request("running", 3, seed=0), make_request("waiting", 3, seed=1)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    finish(sched, waiting)
    assert sched.waiting == [] and sched.running == [running]
    assert_pages_accounted(sched)


def forked_pair() -> tuple[Scheduler, Request, Request]:
    """A leader whose 10-token prompt is computed, and its pending sibling (n=2)."""
    sched = make_scheduler(pages=16, prefix_cache=False)
    leader = make_request("n2", 10)
    sibling = make_request("n2", 10)
    sibling.index, sibling.status = 1, RequestStatus.FORK_PENDING
    leader.pending_forks = [sibling]
    sched.add(leader)
    step(sched)
    return sched, leader, sibling


def test_an_aborted_pending_fork_leaves_its_leader_and_holds_nothing() -> None:
    sched, leader, sibling = forked_pair()
    finish(sched, sibling, leader)
    assert leader.pending_forks == [] and sibling.pages == []
    assert_pages_accounted(sched)


def test_a_page_shared_with_a_sibling_outlives_the_leader() -> None:
    sched, leader, sibling = forked_pair()
    sched.fork(sibling, leader)
    shared = leader.pages[:2]  # the two full pages; the partial one was copied
    assert sibling.pages[:2] == shared and sibling.pages[2] != leader.pages[2]
    assert [sched.cache.pool.ref_counts[p] for p in shared] == [2, 2]
    finish(sched, leader)
    assert [sched.cache.pool.ref_counts[p] for p in shared] == [1, 1]
    assert not set(shared) & set(sched.cache.pool.free)
    assert_pages_accounted(sched)
    finish(sched, sibling)
    assert sched.cache.pool.num_free == 16
    assert_pages_accounted(sched)


def test_churn_of_arrivals_finishes_aborts_and_preemptions_leaks_no_page() -> None:
    rng = random.Random(5)
    sched = make_scheduler(pages=24, max_seqs=6, budget=20)
    live: list[Request] = []
    prefixes = [[rng.randrange(1, 500) for _ in range(2 * PAGE)] for _ in range(2)]
    for n in range(300):
        if n < 220 and rng.random() < 0.5:
            tail = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
            req = make_request(f"q{n}", 0, seed=n, tokens=rng.choice(prefixes) + tail)
            sched.add(req)
            live.append(req)
        if live and rng.random() < 0.1:  # an abort, whatever the request's state
            finish(sched, live.pop(rng.randrange(len(live))))
        step(sched)
        for req in [r for r in live if r.num_output_tokens > rng.randrange(2, 25)]:
            live.remove(req)
            finish(sched, req)
        assert_pages_accounted(sched)
    for req in live:
        finish(sched, req)
    assert not sched.has_work()
    assert sched.num_preemptions > 0 and sched.prefix_hits > 0, "the churn was meant to do both"
    pool = sched.cache.pool
    assert all(count == 0 for count in pool.ref_counts)
    assert pool.num_free + sched.cache.num_cached == pool.num_pages
