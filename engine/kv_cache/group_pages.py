"""GroupPages: a request's pages in every KV group, as the scheduler changes them.

One logical page (page_size tokens of the sequence) is one page id in each group
(engine/kv_cache/kv_groups.py): a request's lists grow together, `pages` (group 0) and
`group_pages` (groups 1..). A sliding group gives back the pages wholly outside the window of
every future query of the request (`reclaim`, each step it is scheduled): the entry then reads
the pool's scratch page, which the kernels never attend to (a sliding layer masks positions
outside its window), and the page goes back to the prefix cache, where it is evictable at once
if it was published, else to the free list.

With one group every method is the single-list bookkeeping of old.

NOTE (overlapped steps): a page given back at a schedule may still be read by the step in
flight (its queries started earlier, so their windows reach further back). It is safe because
every later write into the page, by whichever request gets it next, is made by a step launched
after this one, and steps run in launch order: on one CUDA stream, on the CPU's one device
thread, and on every tensor-parallel rank alike. Fork's page copy runs on the host, but only into
a freshly allocated page, which no launched step reads or writes.
"""

from __future__ import annotations

from typing import Protocol

from engine.kv_cache.block_table import BlockTable, PageHolder
from engine.kv_cache.group_match import GroupHit, match_groups
from engine.kv_cache.kv_groups import first_needed_page
from engine.kv_cache.prefix_cache import PrefixCache


class GroupHolder(PageHolder, Protocol):
    """What the page bookkeeping reads and writes of a request."""

    reclaimed: list[int]
    num_computed_tokens: int


class GroupPages:
    def __init__(self, cache: PrefixCache, table: BlockTable) -> None:
        self.cache = cache
        self.table = table
        groups = cache.pool.groups
        self.num_groups = groups.num_groups
        self.windows = groups.windows
        self.sliding = [(g, w) for g, w in enumerate(groups.windows) if w is not None]

    def needed(self, req: GroupHolder, total: int) -> int:
        """Pages it takes to grow `req` to `total` logical pages."""
        return (total - len(req.pages)) * self.num_groups

    def peak(self, num_tokens: int, chunk: int) -> int:
        """The most pages a request of num_tokens holds, fed at most `chunk` tokens a step:
        every page in a full-attention group; in a sliding one, those its window reaches
        back to from a chunk's first query, and the chunk's."""
        pool = self.cache.pool
        total = pool.pages_for(num_tokens)
        if not self.sliding:
            return total * self.num_groups
        step = min(num_tokens, chunk)
        return sum(
            total if w is None else min(total, pool.pages_for(step + w - 1) + 1)
            for w in self.windows
        )

    def grow(self, req: GroupHolder, total: int) -> None:
        """Extend every group's list to `total` logical pages (the caller checked needed())."""
        allocate = self.cache.allocate
        while len(req.pages) < total:
            req.pages.append(allocate())
            for pages in req.group_pages:
                pages.append(allocate())
        self.table.extend(req)

    def reclaim(self, req: GroupHolder) -> None:
        """Give back every sliding group's pages below its window of the next query."""
        size, scratch = self.cache.pool.page_size, self.cache.pool.scratch_page
        for group, window in self.sliding:
            first = first_needed_page(window, req.num_computed_tokens, size)
            done = req.reclaimed[group]
            if first <= done:
                continue
            pages = req.pages if group == 0 else req.group_pages[group - 1]
            for k in range(done, first):
                if pages[k] != scratch:
                    self.cache.release(pages[k])
                    pages[k] = scratch
            req.reclaimed[group] = first
            if req.slot is not None:
                self.table.rewrite(req, group, done, first)

    def release(self, req: GroupHolder) -> None:
        """Every page of every group back (finish, abort, preemption)."""
        scratch = self.cache.pool.scratch_page
        for pages in [req.pages, *req.group_pages]:
            for page in pages:
                if page != scratch:
                    self.cache.release(page)
        self.table.release(req)
        req.pages = []
        req.group_pages = []
        req.reclaimed = []

    def match(
        self, version: int, token_ids: list[int], max_tokens: int, hashes: list[int], adapter: int
    ) -> GroupHit:
        """The cached prefix's pages per group, referenced; `hashes` gains their chain hashes."""
        if not self.sliding:  # one full-attention group: every page from the first
            pages = self.cache.match(version, token_ids, max_tokens, hashes, adapter)
            return GroupHit(len(pages), [pages], [0], [])
        hit = match_groups(self.cache, version, token_ids, max_tokens, adapter)
        hashes += hit.hashes
        return hit

    def take_hit(self, req: GroupHolder, hit: GroupHit) -> None:
        """Give `req` (no pages yet) the pages `match` found."""
        req.pages = hit.pages[0]
        req.group_pages = hit.pages[1:]
        req.reclaimed = hit.first if self.sliding else []

    def give_back(self, hit: GroupHit) -> None:
        """Release the pages of a match that will not be used."""
        scratch = self.cache.pool.scratch_page
        for pages in hit.pages:
            for page in pages:
                if page != scratch:
                    self.cache.release(page)

    def fork(self, child: GroupHolder, leader: GroupHolder, prompt_len: int) -> bool:
        """Give `child` its leader's pages for the prompt: share the full pages, copy the last
        partial one in each group. False (nothing taken) without free pages for the copies, or
        when a sliding group of the leader gave back a page the child's next query still
        sees; the child then recomputes its prompt instead."""
        pool = self.cache.pool
        full, partial = divmod(prompt_len, pool.page_size)
        if partial and self.cache.num_available < self.num_groups:
            return False
        first = [0] * self.num_groups
        for group, window in self.sliding:
            first[group] = first_needed_page(window, prompt_len, pool.page_size)
            if leader.reclaimed[group] > first[group]:
                return False
        lists = []
        for group, pages in enumerate([leader.pages, *leader.group_pages]):
            shared = pages[:full]
            shared[: first[group]] = [pool.scratch_page] * min(first[group], full)
            for page in shared[first[group] :]:
                pool.retain(page)
            if partial:
                copy = self.cache.allocate()
                pool.copy_page(pages[full], copy)
                shared.append(copy)
            lists.append(shared)
        child.pages, child.group_pages = lists[0], lists[1:]
        child.reclaimed = first if self.sliding else []
        self.table.assign(child)
        return True
