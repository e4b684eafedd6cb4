"""The longest cached prefix every KV group can serve (a model with several groups).

A hit of P tokens (a whole number of pages) lets a request start computing at position P.
Its full-attention groups then need every page below P; a sliding group of window W only the
pages holding keys its query at P can see (positions above P - W): the pages below are never
read again, so they need not be cached. The pages are looked up under the chain hashes shared
by every group (the tokens decide them, not the group), each group in its own index; P is the
largest page count at which every group has what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.kv_groups import first_needed_page
from engine.kv_cache.prefix_cache import PrefixCache, _root


@dataclass
class GroupHit:
    """A match: `num_pages` logical pages cached; per group its page list (the scratch page
    below `first[g]`, pages it need not hold) and `first[g]`; the chain hashes of the pages."""

    num_pages: int
    pages: list[list[int]]
    first: list[int]
    hashes: list[int]


def match_groups(
    cache: PrefixCache, version: int, token_ids: list[int], max_tokens: int, adapter: int
) -> GroupHit:
    """The longest prefix of token_ids[:max_tokens] every group holds, its pages referenced."""
    pool, windows = cache.pool, cache.pool.groups.windows
    size, scratch = pool.page_size, pool.scratch_page
    found: list[list[int | None]] = [[] for _ in windows]
    hashes: list[int] = []
    if cache.enabled:
        parent: int | tuple[int, int] = _root(version, adapter)
        for start in range(0, max_tokens - size + 1, size):
            tokens = tuple(token_ids[start : start + size])
            key = hash((parent, tokens))
            hashes.append(key)
            parent = key
            for group, index in enumerate(cache.indexes):
                page = index.get(key)
                ok = page is not None and cache.tokens_of_page[page] == tokens
                found[group].append(page if ok else None)
            if any(found[g][-1] is None for g, w in enumerate(windows) if w is None):
                break  # a full-attention group misses this page: no longer prefix can hit
    num_pages, first = _longest(found, windows, size)
    lists = []
    for group, pages in enumerate(found):
        held = [scratch] * first[group]
        for page in pages[first[group] : num_pages]:
            assert page is not None
            if pool.ref_counts[page] == 0:
                del cache.evictable[page]
            pool.retain(page)
            held.append(page)
        lists.append(held)
    return GroupHit(num_pages, lists, first, hashes[:num_pages])


def _longest(
    found: list[list[int | None]], windows: tuple[int | None, ...], size: int
) -> tuple[int, list[int]]:
    """The largest page count every group can serve, and each group's first needed page."""
    # runs[g][k]: the first page of the unbroken run of cached pages of group g ending at k.
    runs = []
    for pages in found:
        run, start = [], 0
        for k, page in enumerate(pages):
            if page is None:
                start = k + 1
            run.append(start)
        runs.append(run)
    for num_pages in range(min(len(p) for p in found), 0, -1):
        first = [0 if w is None else first_needed_page(w, num_pages * size, size) for w in windows]
        if all(runs[g][num_pages - 1] <= first[g] for g in range(len(windows))):
            return num_pages, first
    return 0, [0] * len(windows)
