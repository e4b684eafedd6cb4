"""Paged KV storage: K and V pages, a free list and per-page reference counts."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from engine.kv_cache.kv_groups import KVGroups, LayerShape, group_layers, uniform

KVCache = tuple[torch.Tensor, torch.Tensor]


class PagePool:
    """K and V as [layers, pages, page_size, kv_heads, head_dim], handed out a page at a time.

    With `layers` (the model's KVLayout.layers) whose windows or page shapes differ, the layers
    are grouped (engine/kv_cache/kv_groups.py: `groups`) and K and V are `groups.slots`
    tensors each, [pages, elements], the j-th layer of every group in tensor j: one page id is
    one group's page in every layer of that group. A layer's cache is a [pages, page_size,
    kv_heads, head_dim] view of its tensor; where the groups' layers at one slot differ in
    shape, the view of the smaller is page-strided (its rows padded to the larger page).

    A page's reference count is the number of requests whose page table holds it. A page with
    count 0 is on the free list, unless the prefix cache keeps it (see PrefixCache).

    One more page, `scratch_page`, sits past the last page and is never handed out: the padded
    rows of a captured decode step write their KV there (and only there).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layers: Sequence[LayerShape] = (),
    ) -> None:
        groups = group_layers(layers) if layers else uniform(num_layers, kv_heads, head_dim)
        self.groups: KVGroups = groups
        self.device = device
        if groups.simple:
            shape = (num_layers, num_pages + 1, page_size, *groups.shapes[0])
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            self.storage = [self.k, self.v]
        else:
            sizes = groups.slot_elements(page_size)
            self.storage = [
                torch.zeros(num_pages + 1, n, dtype=dtype, device=device) for n in sizes + sizes
            ]
        self.num_pages = num_pages
        self.page_size = page_size
        self.scratch_page = num_pages
        self.ref_counts = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))
        # Tensor parallel (rank 0): the copies made since the last step, which the other ranks
        # make in their own pools before that step's forward (the model runner sends them).
        self.copy_log: list[tuple[int, int]] | None = None

    @staticmethod
    def bytes_per_page(
        page_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * page_size * kv_heads * head_dim * dtype.itemsize

    @staticmethod
    def bytes_per_grouped_page(
        page_size: int, layers: Sequence[LayerShape], dtype: torch.dtype
    ) -> int:
        """What one page id costs in a pool of these layers: K and V in every storage slot."""
        return 2 * sum(group_layers(layers).slot_elements(page_size)) * dtype.itemsize

    @property
    def scratch_slot(self) -> int:
        return self.scratch_page * self.page_size

    def layer_caches(self) -> list[KVCache]:
        """Per model layer, its K and V pages: [pages, page_size, kv_heads, head_dim] each."""
        if self.groups.simple:
            return [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]
        slots, caches = self.groups.slots, []
        for layer, (_, j) in enumerate(self.groups.placement()):
            heads, dim = self.groups.shapes[layer]
            n = self.page_size * heads * dim
            k, v = self.storage[j], self.storage[slots + j]
            shape = (k.shape[0], self.page_size, heads, dim)
            caches.append((k[:, :n].view(shape), v[:, :n].view(shape)))
        return caches

    @property
    def logical_capacity(self) -> int:
        """Logical pages one request surely fits in: a page in every KV group for each (a
        sliding group holds fewer once its window moves on; this bound ignores that)."""
        return self.num_pages // self.groups.num_groups

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_bytes(self) -> int:
        """The K and V storage's bytes, the scratch page included."""
        return sum(t.numel() * t.element_size() for t in self.storage)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take_free(self) -> int:
        """One page off the free list, referenced once. The caller checked num_free."""
        page = self.free.popleft()
        assert self.ref_counts[page] == 0, f"page {page} on the free list is referenced"
        self.ref_counts[page] = 1
        return page

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's K and V in every layer (every storage slot: the slots a page's
        group does not use hold nothing anyone reads)."""
        if self.copy_log is not None:
            self.copy_log.append((src, dst))
        if self.groups.simple:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
            return
        for tensor in self.storage:
            tensor[dst] = tensor[src]

    def retain(self, page: int) -> None:
        self.ref_counts[page] += 1

    def release(self, page: int) -> bool:
        """Drop one reference; True when the page became unreferenced (the caller decides
        whether it goes back to the free list or stays cached)."""
        assert self.ref_counts[page] > 0, f"page {page} released more often than retained"
        self.ref_counts[page] -= 1
        return self.ref_counts[page] == 0

    def put_free(self, page: int) -> None:
        assert self.ref_counts[page] == 0, f"page {page} freed while referenced"
        self.free.append(page)
