"""BlockTable: the page ids of every request that holds pages, one numpy row per slot.

The scheduler is the only code that changes a request's pages, and it keeps this table in
step: a request takes a slot when it gets its first pages (admission, fork), its row gains an
entry when it gains a page, and the slot is freed when its pages are released (preemption,
finish, abort). The model runner then gathers a step's rows with one numpy index instead of
rewriting every row from each request's page list every step.

With several KV groups (engine/kv_cache/kv_groups.py) a slot has a row in each group's table:
`pages` is group 0's, `group_pages[g - 1]` group g's, all indexed by logical page; an entry a
sliding group gave back holds the pool's scratch page.

`epochs[slot]` counts the requests that have held the slot, so per-slot state kept elsewhere
(the model runner's sampling parameters) can tell that a slot changed hands and refresh it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class PageHolder(Protocol):
    """What the table needs of a request (engine/scheduling/request.py's Request): its pages,
    and the slot the table gives it, kept on the request."""

    slot: int | None
    pages: list[int]
    group_pages: list[list[int]]  # groups 1..: same length as pages

    @property
    def key(self) -> tuple[str, int]: ...


class BlockTable:
    def __init__(self, num_slots: int, width: int = 16, num_groups: int = 1) -> None:
        self.pages = np.zeros((max(num_slots, 1), max(width, 1)), dtype=np.int32)
        self.group_pages = [np.zeros_like(self.pages) for _ in range(num_groups - 1)]
        self.num_pages = np.zeros(self.pages.shape[0], dtype=np.int64)  # per slot
        self.epochs = np.zeros(self.pages.shape[0], dtype=np.int64)
        self.free = list(range(self.pages.shape[0] - 1, -1, -1))  # pop() takes the lowest

    @property
    def num_slots(self) -> int:
        return self.pages.shape[0]

    def assign(self, req: PageHolder) -> None:
        """Give a request that just got its pages (admitted, forked) a slot holding them."""
        assert req.slot is None, f"{req.key} already holds slot {req.slot}"
        if not self.free:
            self._resize(2 * self.num_slots, self.pages.shape[1])
        slot = self.free.pop()
        req.slot = slot
        self.epochs[slot] += 1
        self.num_pages[slot] = 0
        self.extend(req)

    def extend(self, req: PageHolder) -> None:
        """Append the pages `req` gained since its row was last written."""
        slot = req.slot
        assert slot is not None, f"{req.key} holds pages but no slot"
        start, end = int(self.num_pages[slot]), len(req.pages)
        if end > self.pages.shape[1]:
            self._resize(self.num_slots, max(end, 2 * self.pages.shape[1]))
        self.pages[slot, start:end] = req.pages[start:end]
        for table, pages in zip(self.group_pages, req.group_pages, strict=True):
            table[slot, start:end] = pages[start:end]
        self.num_pages[slot] = end

    def rewrite(self, req: PageHolder, group: int, start: int, end: int) -> None:
        """Group `group`'s entries [start, end) of `req`'s row again (pages given back)."""
        assert req.slot is not None
        table = self.pages if group == 0 else self.group_pages[group - 1]
        pages = req.pages if group == 0 else req.group_pages[group - 1]
        table[req.slot, start:end] = pages[start:end]

    def tables(self) -> list[np.ndarray]:
        """Every group's table, group 0's first."""
        return [self.pages, *self.group_pages]

    def release(self, req: PageHolder) -> None:
        """Free the slot of a request whose pages were released (no-op without one)."""
        if req.slot is None:
            return
        self.num_pages[req.slot] = 0
        self.free.append(req.slot)
        req.slot = None

    def row(self, req: PageHolder) -> list[int]:
        """The pages the table holds for `req` (what its page list must equal)."""
        assert req.slot is not None
        return self.pages[req.slot, : self.num_pages[req.slot]].tolist()

    def _resize(self, num_slots: int, width: int) -> None:
        """Grow (rare: a fork burst past max_num_seqs, a longer request than seen so far).
        New entries are page 0: any valid id does, they are never attended to."""
        old_slots, old_width = self.pages.shape
        grown = []
        for old in self.tables():
            pages = np.zeros((num_slots, width), dtype=np.int32)
            pages[:old_slots, :old_width] = old
            grown.append(pages)
        self.pages, self.group_pages = grown[0], grown[1:]
        if num_slots > old_slots:
            grow = num_slots - old_slots
            self.num_pages = np.concatenate([self.num_pages, np.zeros(grow, np.int64)])
            self.epochs = np.concatenate([self.epochs, np.zeros(grow, np.int64)])
            self.free = list(range(num_slots - 1, old_slots - 1, -1)) + self.free
