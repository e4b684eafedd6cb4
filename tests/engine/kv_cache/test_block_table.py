"""The scheduler's BlockTable: every request's row equals its pages after every change.

Driven through the Scheduler alone (no model): admission, growth one page at a time,
preemption, finish and the fork of n > 1 siblings each keep the table in step, leave no
stale row behind and hand freed slots out again.
"""

from __future__ import annotations

import random

import torch

from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.page_pool import PagePool
from engine.kv_cache.prefix_cache import PrefixCache
from engine.protocol.messages import SamplingParams
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import ScheduledBatch, Scheduler

PAGE = 4


def make_scheduler(pages: int = 64, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    pool = PagePool(pages, PAGE, 1, 1, 1, torch.float32, torch.device("cpu"))
    return Scheduler(PrefixCache(pool), max_seqs, budget)


def make_request(name: str, prompt_len: int, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(
        request_id=name,
        index=0,
        prompt_len=prompt_len,
        token_ids=[rng.randrange(1, 500) for _ in range(prompt_len)],
        params=SamplingParams(max_tokens=100),
        seed=seed,
        max_tokens=100,
        arrival_seq=seed,
    )


def run_step(sched: Scheduler) -> ScheduledBatch:
    """Schedule, then do what postprocessing does: count the tokens, append one if done."""
    batch = sched.schedule()
    for req, n in zip(batch.requests, batch.query_lens, strict=True):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(7)
    assert_table_matches(sched, extra=[])
    return batch


def assert_table_matches(sched: Scheduler, extra: list[Request]) -> None:
    """Rows equal pages; only requests holding pages hold slots; free + held = all."""
    table = sched.block_table
    holders = [r for r in sched.running + sched.waiting + extra if r.pages]
    for req in sched.running + sched.waiting + extra:
        if req.pages:
            assert req.slot is not None
            assert table.row(req) == req.pages, f"{req.key}: stale row"
        else:
            assert req.slot is None, f"{req.key} holds slot {req.slot} without pages"
    held = [r.slot for r in holders]
    assert len(set(held)) == len(held), "two requests share a slot"
    assert not set(held) & set(table.free), "a held slot is on the free list"
    assert len(table.free) + len(held) == table.num_slots, "a slot leaked"
    for slot in table.free:
        assert table.num_pages[slot] == 0


def test_admitted_rows_equal_pages_and_grow_one_page_at_a_time() -> None:
    sched = make_scheduler()
    reqs = [make_request(f"r{i}", 5 + 3 * i, seed=i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    grown = 0
    for _ in range(12):
        before = {r.key: len(r.pages) for r in reqs}
        run_step(sched)
        grown += sum(len(r.pages) - before[r.key] for r in reqs)
    assert all(r.status is RequestStatus.RUNNING for r in reqs)
    assert sorted(r.slot for r in reqs) == [0, 1, 2, 3]
    # Every page a request holds came through the table (no step rewrote whole rows).
    assert grown == sum(len(r.pages) for r in reqs)


def test_a_decode_grows_only_when_its_next_token_starts_a_page() -> None:
    sched = make_scheduler()
    req = make_request("r", 6)
    sched.add(req)
    calls: list[int] = []
    original = sched._grow

    def counting(r: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        calls.append(num_tokens)
        return original(r, num_tokens, batch)

    sched._grow = counting  # type: ignore[method-assign]
    for _ in range(10):
        run_step(sched)
    # Admission allocates for the prompt (6 tokens: 2 pages); decodes then cross into a
    # third page at token 9 (position 8) and a fourth at token 13 (position 12).
    assert calls == [9, 13]
    assert sched.block_table.row(req) == req.pages and len(req.pages) == 4


def test_preempted_and_finished_requests_free_their_slots_for_reuse() -> None:
    # 12 pages: four requests of 9 prompt tokens (3 pages each) fill the pool; growing one
    # preempts the newest.
    sched = make_scheduler(pages=12, max_seqs=4)
    reqs = [make_request(f"r{i}", 9, seed=i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    run_step(sched)
    for _ in range(6):
        run_step(sched)
    assert sched.num_preemptions > 0
    victim = next(r for r in reqs if r.status is RequestStatus.WAITING)
    assert victim.slot is None and not victim.pages
    epoch = sched.block_table.epochs.copy()
    for finished in list(sched.running):
        sched.remove(finished)
        finished.status = RequestStatus.FINISHED
        assert finished.slot is None
        assert_table_matches(sched, extra=[])
    run_step(sched)
    # The freed slot went to a re-admitted request: a new epoch says its state is new.
    assert victim.status is RequestStatus.RUNNING and victim.slot is not None
    assert sched.block_table.epochs[victim.slot] == epoch[victim.slot] + 1


def test_forked_siblings_get_rows_of_their_own() -> None:
    sched = make_scheduler()
    leader = make_request("n3", 10)
    siblings = [make_request("n3", 10) for _ in range(2)]
    for i, s in enumerate(siblings, start=1):
        s.index, s.status = i, RequestStatus.FORK_PENDING
    leader.pending_forks = list(siblings)
    sched.add(leader)
    sched.schedule()  # the whole prompt in one step
    leader.num_computed_tokens = leader.num_tokens
    for s in siblings:
        sched.fork(s, leader)
    assert_table_matches(sched, extra=[])
    full = 10 // PAGE
    for s in siblings:
        assert s.slot not in (None, leader.slot)
        assert sched.block_table.row(s)[:full] == leader.pages[:full]  # shared full pages
        assert s.pages[full] != leader.pages[full]  # its own copy of the partial one
    for s in siblings:
        s.token_ids.append(7)
    leader.token_ids.append(7)
    for _ in range(4):
        run_step(sched)


def test_randomized_churn_never_leaves_a_stale_row() -> None:
    rng = random.Random(3)
    sched = make_scheduler(pages=16, max_seqs=6, budget=24)
    live: list[Request] = []
    for step in range(200):
        if rng.random() < 0.5:
            req = make_request(f"q{step}", rng.randrange(1, 30), seed=step)
            sched.add(req)
            live.append(req)
        if live and rng.random() < 0.1:
            gone = live.pop(rng.randrange(len(live)))
            sched.remove(gone)
            gone.status = RequestStatus.FINISHED
        run_step(sched)
        for r in [r for r in live if r.num_output_tokens > rng.randrange(5, 40)]:
            live.remove(r)
            sched.remove(r)
            r.status = RequestStatus.FINISHED
        assert_table_matches(sched, extra=[])
    assert sched.num_preemptions > 0, "the churn should have preempted something"


def test_table_grows_past_its_slots_and_width() -> None:
    table = BlockTable(num_slots=1, width=2)
    a, b = make_request("a", 1), make_request("b", 1)
    a.pages, b.pages = [3, 4, 5], [6]
    table.assign(a)
    table.assign(b)
    assert table.num_slots == 2 and table.row(a) == [3, 4, 5] and table.row(b) == [6]
    a.pages.append(9)
    table.extend(a)
    assert table.row(a) == [3, 4, 5, 9]
