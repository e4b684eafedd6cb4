"""The step's token budget: decodes first (one token each, so they never stall behind a long
prompt), then running prompts' chunks, then new admissions; a prompt longer than what is left
is split across steps, and no step exceeds the budget or max_num_seqs.

A Scheduler over a small page pool, no model (tests/support/scheduler_builders.py).
"""

from __future__ import annotations

import random

from engine.scheduling.request import Request
from tests.support.scheduler_builders import (
    assert_pages_accounted,
    finish,
    make_request,
    make_scheduler,
    step,
)


def query_lens_of(req: Request, batches: list[tuple[list[Request], list[int]]]) -> list[int]:
    return [n for reqs, lens in batches for r, n in zip(reqs, lens, strict=True) if r is req]


def test_a_prompt_longer_than_the_budget_is_computed_in_chunks_of_the_budget() -> None:
    sched = make_scheduler(budget=16)
    req = make_request("long", 40)
    sched.add(req)
    batches = []
    for _ in range(4):
        batch = step(sched)
        batches.append((list(batch.requests), list(batch.query_lens)))
    assert query_lens_of(req, batches) == [16, 16, 8, 1]  # three chunks, then a decode
    assert req.num_output_tokens == 2


def test_running_decodes_take_their_token_before_a_long_prompt_takes_the_rest() -> None:
    sched = make_scheduler(budget=8)
    decoding = [make_request(f"d{i}", 3, seed=i) for i in range(3)]
    for req in decoding:
        sched.add(req)
    step(sched)
    long = make_request("long", 30, seed=9)
    sched.add(long)
    while long.num_output_tokens == 0:
        batch = step(sched)
        assert batch.requests[:3] == decoding and batch.query_lens[:3] == [1, 1, 1]
        assert batch.requests[3:] == [long] and batch.query_lens[3] <= 5
    assert long.num_computed_tokens == 30


def test_a_prompt_part_way_through_takes_the_budget_before_a_new_admission() -> None:
    sched = make_scheduler(budget=16)
    first, second = make_request("first", 40, seed=0), make_request("second", 8, seed=1)
    sched.add(first)
    step(sched)
    sched.add(second)
    batch = step(sched)
    assert batch.requests == [first] and batch.query_lens == [16]
    batch = step(sched)
    assert batch.requests == [first, second] and batch.query_lens == [8, 8]


def test_no_step_exceeds_the_token_budget_or_max_num_seqs() -> None:
    rng = random.Random(11)
    sched = make_scheduler(pages=40, max_seqs=5, budget=24)
    live: list[Request] = []
    for n in range(150):
        if rng.random() < 0.5:
            req = make_request(f"q{n}", rng.randrange(1, 60), seed=n)
            sched.add(req)
            live.append(req)
        batch = step(sched)
        assert batch.num_tokens == sum(batch.query_lens) <= 24
        assert len(batch.requests) == len(set(map(id, batch.requests))) <= 5
        assert all(n >= 1 for n in batch.query_lens)
        for req in [r for r in live if r.num_output_tokens > rng.randrange(2, 20)]:
            live.remove(req)
            finish(sched, req)
        assert_pages_accounted(sched)
    assert sched.num_preemptions > 0, "the pool was meant to be tight enough to preempt"
