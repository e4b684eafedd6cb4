"""Small builders for the scheduler and the KV cache's bookkeeping, with no model and no
checkpoint: a page pool of a few one-float pages, the prefix cache over it, a Scheduler, and
requests of a given prompt length. `advance` does to a scheduled batch what the engine's
postprocessing does (count the computed tokens, append a sampled token where a prompt or
decode ended), and `assert_pages_accounted` is the page-leak check every test can end with.

The tests built on these call the Scheduler's public methods only: `add`, `schedule`,
`remove`, `fork`, `preempt` and `has_work`, and read `running`, `waiting`, `too_big`,
`num_preemptions`, `prefix_hits` and `block_table`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

import torch

from engine.kv_cache.page_pool import PagePool
from engine.kv_cache.prefix_cache import PrefixCache
from engine.models.base import LayerKV
from engine.protocol.messages import SamplingParams
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import ScheduledBatch, Scheduler

PAGE = 4  # tokens per page: small enough that a few tokens cross a page
SAMPLED = 7  # the token `advance` appends for a finished prompt or a decode


def make_pool(pages: int = 64, page_size: int = PAGE) -> PagePool:
    """A pool of `pages` pages whose K and V are one float each (the bookkeeping is the point)."""
    return PagePool(pages, page_size, 1, 1, 1, torch.float32, torch.device("cpu"))


def make_cache(pages: int = 64, page_size: int = PAGE, enabled: bool = True) -> PrefixCache:
    return PrefixCache(make_pool(pages, page_size), enabled=enabled)


def make_grouped_scheduler(
    windows: list[int | None],
    pages: int = 64,
    max_seqs: int = 8,
    budget: int = 32,
    page_size: int = PAGE,
    prefix_cache: bool = True,
) -> Scheduler:
    """make_scheduler over a model whose layer i attends over `windows[i]` (None: full)."""
    layers = [LayerKV(1, 1, w) for w in windows]
    cpu = torch.device("cpu")
    pool = PagePool(pages, page_size, len(layers), 1, 1, torch.float32, cpu, layers)
    return Scheduler(PrefixCache(pool, enabled=prefix_cache), max_seqs, budget)


def held_pages(req: Request, scratch: int) -> list[int]:
    """Every page `req` holds, in every KV group (given-back entries aside)."""
    return [p for pages in [req.pages, *req.group_pages] for p in pages if p != scratch]


def make_scheduler(
    pages: int = 64,
    max_seqs: int = 8,
    budget: int = 32,
    page_size: int = PAGE,
    prefix_cache: bool = True,
) -> Scheduler:
    """A Scheduler over `pages` pages of `page_size` tokens, at most `max_seqs` running
    requests and `budget` tokens a step."""
    return Scheduler(make_cache(pages, page_size, prefix_cache), max_seqs, budget)


def make_request(
    name: str,
    prompt_len: int,
    seed: int = 0,
    *,
    tokens: list[int] | None = None,
    priority: int = 0,
    arrival: int | None = None,
) -> Request:
    """A request of `prompt_len` random token ids (or `tokens`), arriving `arrival`-th
    (default: `seed`), with room for 100 output tokens."""
    rng = random.Random(seed)
    prompt = tokens if tokens is not None else [rng.randrange(1, 500) for _ in range(prompt_len)]
    return Request(
        request_id=name,
        index=0,
        prompt_len=len(prompt),
        token_ids=list(prompt),
        params=SamplingParams(max_tokens=100),
        seed=seed,
        max_tokens=100,
        arrival_seq=seed if arrival is None else arrival,
        priority=priority,
    )


def advance(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does with a step's batch: marks its requests scheduled (a later
    admission is then a resume), counts the fed tokens as computed, publishes the full pages
    of each to the prefix cache, and appends a sampled token to each request whose computed
    tokens reached its end; and has the scheduler count the step's prefix-cache lookups."""
    sched.count(batch)
    for req, n in zip(batch.requests, batch.query_lens, strict=True):
        if req.first_scheduled_time is None:
            req.first_scheduled_time = 0.0
        req.num_computed_tokens += n
        sched.cache.publish(
            sched.policy_version,
            req.token_ids,
            req.pages,
            req.num_computed_tokens,
            req.page_hashes,
            req.adapter_key,
            req.group_pages,
        )
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(SAMPLED)


def step(sched: Scheduler) -> ScheduledBatch:
    """Schedule one step and advance it."""
    batch = sched.schedule()
    advance(sched, batch)
    return batch


def finish(sched: Scheduler, req: Request, leader: Request | None = None) -> None:
    """End a request as the engine does on a finish or an abort: out of the scheduler."""
    sched.remove(req, leader)
    req.status = RequestStatus.FINISHED


def assert_pages_accounted(sched: Scheduler, live: Iterable[Request] = ()) -> None:
    """No page leaked and none counted twice: each page's reference count is the number of
    requests holding it (the scheduler's queues and `live`, e.g. pending forks); an
    unreferenced page is either free or cached, never both; and free + cached + held pages
    are the whole pool."""
    cache, pool = sched.cache, sched.cache.pool
    holders = {id(r): r for r in [*sched.running, *sched.waiting, *live]}.values()
    held = Counter(page for r in holders for page in held_pages(r, pool.scratch_page))
    assert [pool.ref_counts[p] for p in range(pool.num_pages)] == [
        held[p] for p in range(pool.num_pages)
    ], "a page's reference count is not the number of requests holding it"
    free, cached = list(pool.free), list(cache.evictable)
    assert len(set(free)) == len(free), "a page is on the free list twice"
    assert not set(free) & set(cached), "a page is both free and cached"
    assert not (set(free) | set(cached)) & set(held), "a held page is free or cached"
    assert len(free) + len(cached) + len(held) == pool.num_pages, "a page leaked"
