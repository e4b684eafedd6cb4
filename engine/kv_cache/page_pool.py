"""Paged KV storage: K and V pages, a free list and per-page reference counts."""

from __future__ import annotations

from collections import deque

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]


class PagePool:
    """K and V as [layers, pages, page_size, kv_heads, head_dim], handed out a page at a time.

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
    ) -> None:
        shape = (num_layers, num_pages + 1, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
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

    @property
    def scratch_slot(self) -> int:
        return self.scratch_page * self.page_size

    def layer_caches(self) -> list[KVCache]:
        return [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

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
        """Copy one page's K and V in every layer."""
        if self.copy_log is not None:
            self.copy_log.append((src, dst))
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

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
