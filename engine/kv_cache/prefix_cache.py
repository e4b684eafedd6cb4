"""Prefix cache: full KV pages keyed by a hash chained over (policy version, LoRA adapter,
parent, tokens).

It also hands out pages: from the pool's free list first, and only when that is empty by
evicting the least recently used unreferenced cached page. A hit re-checks the page's token
ids (hashes can collide) and shares the page by reference count. Folding the policy version
into the hash means pages computed by older weights are never reused; folding the adapter's
key (engine/lora/registry.py; 0 for the base model) means one adapter's KV never serves
another's requests, nor the base model's.

With `events` a list (the engine process sets one; None records nothing), the cache records
what changes in its index (engine/protocol/kv_events.py): pages published, as one BlockStored
per chain a publish() registers; hashed pages evicted (BlockRemoved); clear()
(AllBlocksCleared). The owner takes the list and puts a fresh one in its place.

With several KV groups (engine/kv_cache/kv_groups.py) each group has an index of its own under
the same chain hashes (a page id belongs to one group); the events describe group 0's pages
only, the full-attention group's when the model has one. A sliding group's page given back
while its request runs is such a cached page too, evictable at once. engine/kv_cache/
group_match.py finds the longest prefix every group can serve.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.kv_cache.page_pool import PagePool
from engine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class PrefixCache:
    def __init__(self, pool: PagePool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.page_of_hash: dict[int, int] = {}  # group 0's
        # Per group (group 0's is page_of_hash); the group of each page of groups 1.. cached.
        self.indexes = [self.page_of_hash] + [{} for _ in range(pool.groups.num_groups - 1)]
        self.group_of_page: dict[int, int] = {}
        self.hash_of_page: dict[int, int] = {}
        self.tokens_of_page: dict[int, tuple[int, ...]] = {}
        self.evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # unreferenced cached pages, LRU first
        self.events: list[KvEvent] | None = None  # None: nobody reads them

    @property
    def num_available(self) -> int:
        """Pages that allocate() can hand out now."""
        return self.pool.num_free + len(self.evictable)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for reuse (reclaimable)."""
        return len(self.evictable)

    def allocate(self) -> int:
        if self.pool.num_free:
            return self.pool.take_free()
        page, _ = self.evictable.popitem(last=False)
        group = self.group_of_page.get(page, 0)
        key = self._forget(page)
        if self.events is not None and group == 0:
            self._removed(key)
        assert self.pool.ref_counts[page] == 0, f"evicted page {page} is referenced"
        self.pool.ref_counts[page] = 1
        return page

    def release(self, page: int) -> None:
        if not self.pool.release(page):
            return
        if page in self.hash_of_page:
            self.evictable[page] = None  # most recently used last
        else:
            self.pool.put_free(page)

    def match(
        self,
        version: int,
        token_ids: list[int],
        max_tokens: int,
        hashes: list[int],
        adapter: int = 0,
    ) -> list[int]:
        """Referenced pages holding the longest cached prefix of token_ids[:max_tokens]
        computed under `version` and `adapter`.

        `hashes` (empty on entry) receives the chain hash of every matched page.
        """
        if not self.enabled:
            return []
        size = self.pool.page_size
        root = _root(version, adapter)
        pages: list[int] = []
        for start in range(0, max_tokens - size + 1, size):
            tokens = tuple(token_ids[start : start + size])
            key = hash((hashes[-1] if hashes else root, tokens))
            page = self.page_of_hash.get(key)
            if page is None or self.tokens_of_page[page] != tokens:
                break
            if self.pool.ref_counts[page] == 0:
                del self.evictable[page]
            self.pool.retain(page)
            pages.append(page)
            hashes.append(key)
        return pages

    def publish(
        self,
        version: int,
        token_ids: list[int],
        pages: list[int],
        num_tokens: int,
        hashes: list[int],
        adapter: int = 0,
        group_pages: Sequence[list[int]] = (),
    ) -> None:
        """Register the full pages among the first num_tokens (computed) tokens for reuse:
        `pages` (group 0's) and, with several KV groups, `group_pages` (groups 1..'s; a
        page given back, the scratch page, is skipped).

        `hashes` holds the chain hashes of the pages published so far and is extended, so
        each page is hashed once over a request's life.
        """
        if not self.enabled:
            return
        size = self.pool.page_size
        root = _root(version, adapter)
        events, run, scratch = self.events, None, self.pool.scratch_page
        for i in range(len(hashes), num_tokens // size):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent = hashes[-1] if hashes else None
            key = hash((root if parent is None else parent, tokens))
            hashes.append(key)
            for group, held in enumerate(group_pages, 1):
                self._register(group, key, held[i], tokens)
            page = pages[i]
            if page == scratch:  # a sliding group 0 gave it back before it was published
                continue
            if page not in self.hash_of_page and key not in self.page_of_hash:
                self.page_of_hash[key] = page
                self.hash_of_page[page] = key
                self.tokens_of_page[page] = tokens
                if events is None:
                    continue
                # One event per unbroken chain of pages this call registers.
                if run is not None and run.block_hashes[-1] == parent:
                    run.block_hashes.append(key)
                    run.token_ids.append(tokens)
                else:
                    run = BlockStored([key], parent, [tokens], adapter)
                    events.append(run)

    def clear(self) -> None:
        """Forget every entry (a weight update, a sleep, a flush); unreferenced cached pages
        become free, referenced ones go back to the free list when released."""
        for page in list(self.evictable):
            del self.evictable[page]
            self.pool.put_free(page)
        for index in self.indexes:
            index.clear()
        self.group_of_page.clear()
        self.hash_of_page.clear()
        self.tokens_of_page.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KvEvent] | None:
        """The events recorded since the last take, oldest first (None: none, or not
        recording); recording goes on."""
        events = self.events
        if not events:
            return None
        self.events = []
        return events

    def _register(self, group: int, key: int, page: int, tokens: tuple[int, ...]) -> None:
        """A page of group 1.. under `key` (no event: events describe group 0)."""
        index = self.indexes[group]
        if page == self.pool.scratch_page or page in self.hash_of_page or key in index:
            return
        index[key] = page
        self.hash_of_page[page] = key
        self.tokens_of_page[page] = tokens
        self.group_of_page[page] = group

    def _forget(self, page: int) -> int:
        key = self.hash_of_page.pop(page)
        del self.indexes[self.group_of_page.pop(page, 0)][key]
        del self.tokens_of_page[page]
        return key

    def _removed(self, key: int) -> None:
        assert self.events is not None
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):  # an allocation burst evicts many: one event
            last.block_hashes.append(key)
        else:
            self.events.append(BlockRemoved([key]))


def _root(version: int, adapter: int) -> int | tuple[int, int]:
    """What a chain's first page hashes with: the base model's chains as before adapters."""
    return version if not adapter else (version, adapter)
