"""Admission: waiting requests join the running batch by priority, then arrival, while the
pages, the running places and the step's token budget allow; no request overtakes one that
waits for pages, and one that alone cannot fit the pool is dropped without blocking the rest.

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


def test_requests_are_admitted_while_their_pages_fit_and_the_rest_wait() -> None:
    sched = make_scheduler(pages=8, budget=64, prefix_cache=False)
    a, b, c = (make_request(name, 10, seed=i) for i, name in enumerate("abc"))
    for req in (a, b, c):
        sched.add(req)
    batch = step(sched)
    # 10 tokens take 3 pages of 4: a and b hold 6 of the 8, c's 3 do not fit.
    assert batch.requests == [a, b] and batch.query_lens == [10, 10]
    assert [len(a.pages), len(b.pages)] == [3, 3]
    assert sched.waiting == [c] and c.status is RequestStatus.WAITING and c.pages == []
    assert_pages_accounted(sched)
    finish(sched, a)
    batch = step(sched)
    assert c in batch.requests and c.status is RequestStatus.RUNNING and len(c.pages) == 3
    assert_pages_accounted(sched)


def test_a_request_waiting_for_pages_is_not_overtaken_by_a_smaller_one() -> None:
    sched = make_scheduler(pages=8, budget=64, prefix_cache=False)
    running = make_request("running", 20, seed=0)  # 5 pages
    sched.add(running)
    step(sched)
    big, small = make_request("big", 16, seed=1), make_request("small", 2, seed=2)
    sched.add(big)  # 4 pages, 3 free
    sched.add(small)  # 1 page would fit
    batch = step(sched)
    assert batch.requests == [running]
    assert sched.waiting == [big, small]


def test_no_more_than_max_num_seqs_requests_run() -> None:
    sched = make_scheduler(max_seqs=2, budget=64)
    reqs = [make_request(f"r{i}", 3, seed=i) for i in range(3)]
    for req in reqs:
        sched.add(req)
    for _ in range(3):
        batch = step(sched)
        assert len(batch.requests) == 2
    assert sched.running == reqs[:2] and sched.waiting == reqs[2:]


def test_higher_priority_is_admitted_first_then_earlier_arrival() -> None:
    sched = make_scheduler(max_seqs=1)
    low = make_request("low", 3, seed=0, priority=0)
    high = make_request("high", 3, seed=1, priority=5)
    later_low = make_request("later-low", 3, seed=2, priority=0)
    for req in (later_low, low, high):  # the order they are added in does not matter
        sched.add(req)
    assert step(sched).requests == [high]
    assert sched.waiting == [low, later_low]


def test_the_budget_left_by_running_requests_bounds_a_new_admission() -> None:
    sched = make_scheduler(budget=8)
    decoding = [make_request(f"d{i}", 2, seed=i) for i in range(3)]
    for req in decoding:
        sched.add(req)
    step(sched)  # 3 prompts of 2 tokens: now each decodes one token a step
    newcomer = make_request("new", 30, seed=9)
    sched.add(newcomer)
    batch = step(sched)
    assert batch.requests == [*decoding, newcomer]
    assert batch.query_lens == [1, 1, 1, 5]  # what the decodes leave of 8


def test_a_request_that_alone_cannot_fit_the_pool_is_dropped_and_the_next_is_admitted() -> None:
    sched = make_scheduler(pages=4, budget=64)  # 16 tokens in all
    # A prompt of exactly 16 tokens does not fit: its sampled token needs a 17th place.
    huge = make_request("huge", 4 * PAGE, seed=0)
    fits = make_request("fits", 4 * PAGE - 1, seed=1)
    sched.add(huge)
    sched.add(fits)
    batch = step(sched)
    assert sched.too_big == [huge]
    assert huge.status is RequestStatus.FINISHED and huge.pages == [] and huge.slot is None
    assert batch.requests == [fits] and len(fits.pages) == 4
    assert_pages_accounted(sched)


def test_a_leader_reserves_the_places_of_its_pending_siblings() -> None:
    sched = make_scheduler(max_seqs=3)
    leader = make_request("pair", 6, seed=0)
    sibling = make_request("pair", 6, seed=0)
    sibling.index, sibling.status = 1, RequestStatus.FORK_PENDING
    leader.pending_forks = [sibling]
    singles = [make_request(f"single-{k}", 5, seed=k + 1) for k in range(2)]
    for req in (leader, *singles):
        sched.add(req)
    batch = step(sched)
    # The pair takes two of the three places: one single joins, the other waits.
    assert batch.requests == [leader, singles[0]]
    assert sched.waiting == [singles[1]]
    assert_pages_accounted(sched)


def test_a_running_leader_keeps_the_places_of_its_pending_siblings() -> None:
    sched = make_scheduler(max_seqs=3, budget=8)
    leader = make_request("pair", 12, seed=0)  # its prompt takes two steps of 8
    sibling = make_request("pair", 12, seed=0)
    sibling.index, sibling.status = 1, RequestStatus.FORK_PENDING
    leader.pending_forks = [sibling]
    sched.add(leader)
    step(sched)
    singles = [make_request(f"single-{k}", 2, seed=k + 1) for k in range(2)]
    for req in singles:
        sched.add(req)
    batch = step(sched)
    assert batch.requests == [leader, singles[0]] and sched.waiting == [singles[1]]


def test_no_admission_while_admitting_is_off() -> None:
    # A weight update drains the running requests: waiting ones stay waiting until it ends.
    sched = make_scheduler()
    req = make_request("r", 5)
    sched.add(req)
    sched.admitting = False
    assert not step(sched)
    sched.admitting = True
    assert step(sched).requests == [req]


def test_an_admitted_request_shares_the_cached_pages_of_an_earlier_prompt() -> None:
    sched = make_scheduler()
    prefix = list(range(100, 100 + 2 * PAGE))
    first = make_request("first", 0, seed=0, tokens=prefix + [1, 2])
    sched.add(first)
    step(sched)  # computes and publishes its two full pages
    second = make_request("second", 0, seed=1, tokens=prefix + [3, 4, 5])
    sched.add(second)
    batch = step(sched)
    assert second.pages[:2] == first.pages[:2]
    assert [sched.cache.pool.ref_counts[p] for p in second.pages[:2]] == [2, 2]
    assert batch.query_lens[-1] == 3 and second.num_computed_tokens == 2 * PAGE + 3
    assert second.num_cached_tokens == 2 * PAGE and sched.prefix_hits == 2 * PAGE
    assert_pages_accounted(sched)


def test_a_prompt_found_whole_in_the_cache_still_computes_its_last_page() -> None:
    sched = make_scheduler()
    prompt = list(range(100, 100 + 2 * PAGE))
    first = make_request("first", 0, seed=0, tokens=prompt)
    sched.add(first)
    step(sched)
    again = make_request("again", 0, seed=1, tokens=list(prompt))
    sched.add(again)
    batch = step(sched)
    # The last token's logits must be computed to sample from: its page is not taken whole.
    assert again.pages[0] == first.pages[0] and again.pages[1] != first.pages[1]
    assert batch.query_lens[-1] == PAGE and again.num_cached_tokens == PAGE
    assert_pages_accounted(sched)
