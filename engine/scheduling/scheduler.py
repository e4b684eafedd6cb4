"""Continuous batching: which requests advance this step, and by how many tokens.

Each step, under a token budget and max_num_seqs:
1. running requests that are decoding take one token each (so decodes never stall behind
   a long prefill), then running requests part-way through a chunked prefill take a chunk;
2. waiting requests are admitted by priority, then arrival, while pages and budget allow;
   a prompt longer than the remaining budget is split across steps (chunked prefill).
A decoding request with a speculative draft (engine/speculative/) feeds its last token and the
draft; the draft is cut to what the step's budget and the free pages hold without preempting.
When a running request needs a page and none is available, the newest running request is
preempted: its pages are released and it is re-queued to recompute (its generated tokens are
kept). Only a request that alone cannot fit in the whole pool is ended, with ERROR.

A model whose layers form several KV groups (sliding windows: engine/kv_cache/kv_groups.py)
takes a page in every group per logical page; each step, before anything grows, every running
request's sliding groups give back the pages outside their windows (engine/kv_cache/
group_pages.py), so a long request holds about window / page_size pages there.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.group_pages import GroupPages
from engine.kv_cache.prefix_cache import PrefixCache
from engine.scheduling.request import Request, RequestStatus

RUNNING = RequestStatus.RUNNING


@dataclass
class ScheduledBatch:
    """Requests advancing this step, in packed order, with the tokens each feeds; their page
    rows are in `block_table` (at each request's `slot`)."""

    requests: list[Request] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    block_table: BlockTable | None = None
    num_tokens: int = field(init=False)  # sum(query_lens), kept as rows come and go
    admitted: list[Request] = field(default_factory=list)  # from the queue, by this schedule
    first_admitted: list[Request] = field(default_factory=list)  # ... for the first time
    preempted: bool = False  # this schedule preempted a running request
    drafts: bool = False  # some request feeds a speculative draft (engine/speculative/)

    def __post_init__(self) -> None:
        self.num_tokens = sum(self.query_lens)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def add(self, req: Request, num_tokens: int) -> None:
        self.requests.append(req)
        self.query_lens.append(num_tokens)
        self.num_tokens += num_tokens

    def discard(self, req: Request) -> None:
        if req in self.requests:
            i = self.requests.index(req)
            self.num_tokens -= self.query_lens[i]
            del self.requests[i], self.query_lens[i]


# Whether a waiting request's LoRA adapter (its key) holds a slot, given one if it can be, with
# these requests running (engine/lora/registry.py); None without adapters. A request whose
# adapter cannot have a slot waits, and so do those behind it.
AdapterGate = Callable[[int, list[Request]], bool]


class Scheduler:
    def __init__(
        self,
        cache: PrefixCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy_version: int = 0,
        adapter_gate: AdapterGate | None = None,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # admission order: the last is the newest
        self.num_preemptions = 0
        self.policy_version = policy_version  # folded into prefix-cache hashes
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (steps that ran)
        self.prefix_hits = 0  # prompt tokens found there
        self.too_big: list[Request] = []  # requests that alone cannot fit; the engine ends them
        self.admitting = True  # False while a weight update drains the running requests
        groups = cache.pool.groups.num_groups
        self.block_table = BlockTable(max_num_seqs, num_groups=groups)  # every page change
        self.pages = GroupPages(cache, self.block_table)  # ... goes through both
        self.adapter_gate = adapter_gate
        self.speculative = False  # requests may carry drafts to verify (engine/speculative/)

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens fits the whole pool, at the most pages it holds."""
        chunk = self.max_num_batched_tokens
        return self.pages.peak(num_tokens, chunk) <= self.cache.pool.num_pages

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def remove(self, req: Request, leader: Request | None = None) -> None:
        """Take a request out of the queues and release its pages (finish or abort)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.FORK_PENDING:
            assert leader is not None, "a pending fork is removed through its leader"
            leader.pending_forks.remove(req)
        self._release_pages(req)

    def fork(self, child: Request, leader: Request) -> None:
        """Start a sibling on its leader's computed prompt: share the full pages, copy the last
        partial one (in every KV group; a sliding group's within its window). Without free
        pages for the copies, or when the leader gave back a page the sibling still needs, the
        sibling queues to recompute instead (same tokens, more work)."""
        leader.pending_forks.remove(child)
        full = child.prompt_len // self.cache.pool.page_size
        assert leader.num_computed_tokens >= child.prompt_len, "fork before the prompt is computed"
        if not self.pages.fork(child, leader, child.prompt_len):
            self.add(child)
            return
        child.page_hashes = leader.page_hashes[:full]
        child.publish_pages = leader.publish_pages
        child.num_computed_tokens = child.prompt_len
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, hold: Collection[Request] = ()) -> ScheduledBatch:
        """The next batch, linear in the running requests: a running token count, and `_grow`
        only for a request whose new tokens reach past its last page (a decode: once a page).
        Requests in `hold` sit this step out (an overlapped step holds those whose token
        still being sampled may end them): running ones keep their pages, admission stops at
        a waiting one."""
        batch = ScheduledBatch(block_table=self.block_table)
        if self.pages.sliding:  # pages outside the windows back first: growing may use them
            for r in self.running:
                self.pages.reclaim(r)
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for r in [r for r in self.running if r not in hold] if hold else self.running:
            left = len(r.token_ids) + r.num_pending - r.num_computed_tokens  # r.num_tokens, inline
            if left == 1:
                decoding.append(r)
            elif left > 1:
                prefilling.append(r)
        size, limit, running = self.cache.pool.page_size, self.max_num_batched_tokens, RUNNING
        if self.speculative and any([r.draft for r in decoding]):
            self._decode_drafts(decoding, batch)
        elif len(decoding) <= limit:
            # Every decode fits the budget: grow the few that start a page, in order (growing
            # may preempt newer requests), then take every decode still running.
            for req in [r for r in decoding if r.num_computed_tokens >= len(r.pages) * size]:
                if req.status is running:
                    self._grow(req, req.num_computed_tokens + 1, batch)
            batch.requests = [r for r in decoding if r.status is running]
            batch.query_lens = [1] * len(batch.requests)
            batch.num_tokens = len(batch.requests)
        else:
            for req in decoding:
                if batch.num_tokens == limit:
                    break
                if req.status is not running:
                    continue  # preempted earlier in this loop
                end = req.num_computed_tokens + 1
                if end <= len(req.pages) * size or self._grow(req, end, batch):
                    batch.add(req, 1)
        for req in prefilling:
            budget = limit - batch.num_tokens
            if budget == 0:
                break
            if req.status is not running:
                continue
            end = req.num_computed_tokens + min(req.num_tokens - req.num_computed_tokens, budget)
            if end <= len(req.pages) * size or self._grow(req, end, batch):
                batch.add(req, end - req.num_computed_tokens)
        self._admit(batch, hold)
        return batch

    def _decode_drafts(self, decoding: list[Request], batch: ScheduledBatch) -> None:
        """Decodes of which some verify a draft (engine/speculative/): each takes its last
        token as any decode does (growing, preempting if it must), then its draft as far as
        the step's budget and pages free without preempting allow (the rest is cut)."""
        size, limit = self.cache.pool.page_size, self.max_num_batched_tokens
        for req in decoding:
            if batch.num_tokens == limit:
                break
            if req.status is not RUNNING:
                continue
            end = req.num_computed_tokens + 1
            if end > len(req.pages) * size and not self._grow(req, end, batch):
                continue
            draft = req.draft
            del draft[limit - batch.num_tokens - 1 :]
            total = self.cache.pool.pages_for(end + len(draft))
            if total > len(req.pages):
                free = self.fits(end + len(draft))
                if free and self.pages.needed(req, total) <= self.cache.num_available:
                    self.pages.grow(req, total)
                else:
                    del draft[len(req.pages) * size - end :]
            batch.add(req, 1 + len(draft))
            batch.drafts = batch.drafts or bool(draft)

    def _grow(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give a running request pages for num_tokens, preempting newer requests if needed."""
        total = self.cache.pool.pages_for(num_tokens)
        if not self.fits(num_tokens):
            self._drop_too_big(req)
            return False
        while self.pages.needed(req, total) > self.cache.num_available:
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted = True
            batch.discard(victim)  # it may have been scheduled earlier in this step
            if victim is req:
                return False
        self.pages.grow(req, total)
        return True

    def _admit(self, batch: ScheduledBatch, hold: Collection[Request]) -> None:
        if not (self.waiting and self.admitting):
            return
        # NOTE: running leaders' pending siblings join when their prompts are done: their
        # places are taken, or a step could sample more rows than max_num_seqs.
        taken = len(self.running) + sum([len(r.pending_forks) for r in self.running])
        while self.waiting and self.admitting:
            budget = self.max_num_batched_tokens - batch.num_tokens
            req = self.waiting[0]
            group = 1 + len(req.pending_forks)  # the siblings join when the prompt is done
            if budget == 0 or taken + group > self.max_num_seqs or req in hold:
                break
            # NOTE: at least the last token must be computed, so its logits exist to sample.
            if not self.fits(req.num_tokens + 1):
                self.waiting.pop(0)
                self._drop_too_big(req)
                continue
            gate = self.adapter_gate
            if req.adapter_key and gate is not None and not gate(req.adapter_key, self.running):
                break  # every slot's adapter runs requests: its turn comes when they end
            # The cache may not supply a position whose prompt logprob is still to be scored.
            limit = req.num_tokens - 1
            if req.prompt_scores is not None:
                limit = min(limit, req.prompt_scores.cache_limit)
            hit = self.pages.match(
                self.policy_version, req.token_ids, limit, req.page_hashes, req.adapter_key
            )
            num_cached = hit.num_pages * self.cache.pool.page_size
            num_tokens = min(req.num_tokens - num_cached, budget)
            total = self.cache.pool.pages_for(num_cached + num_tokens)
            if (total - hit.num_pages) * self.pages.num_groups > self.cache.num_available:
                self.pages.give_back(hit)  # try again next step
                req.page_hashes.clear()
                break
            self.waiting.pop(0)
            self.pages.take_hit(req, hit)
            self.block_table.assign(req)
            self.pages.grow(req, total)
            req.num_computed_tokens = num_cached
            if req.first_scheduled_time is None:  # first admission, not a resume
                req.num_cached_tokens = num_cached
                batch.first_admitted.append(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            taken += group
            batch.add(req, num_tokens)
            batch.admitted.append(req)

    def count(self, batch: ScheduledBatch) -> None:
        """Count a batch's prefix-cache lookups once its step has run (one given back before
        it ran, engine/core/step_loop.py, is never counted)."""
        for req in batch.first_admitted:
            self.prefix_queries += req.prompt_len
            self.prefix_hits += req.num_cached_tokens

    def preempt(self, req: Request) -> None:
        """Release a running request's pages and queue it to recompute; tokens are kept."""
        self.requeue(req)
        self.num_preemptions += 1

    def requeue(self, req: Request) -> None:
        """A running request back to the queue, its pages released, as if never admitted (a
        step given back: not a preemption)."""
        self.running.remove(req)
        self._release_pages(req)
        req.num_computed_tokens = 0
        self.add(req)

    def _drop_too_big(self, req: Request) -> None:
        """Out of the queues, pages released; the engine ends it (and any pending siblings)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self._release_pages(req)
        req.status = RequestStatus.FINISHED
        self.too_big.append(req)

    def _release_pages(self, req: Request) -> None:
        self.pages.release(req)
        req.page_hashes.clear()
