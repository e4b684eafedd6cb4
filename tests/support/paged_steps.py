"""A packed attention step over a random paged cache, for the attention backends' tests."""

from __future__ import annotations

import random

import torch

from engine.attention.backend import FULL, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.layers.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Step:
    """A packed step over a random paged cache: what one layer's attention sees, q and k not
    yet rotated (the backend rotates them at `positions`)."""

    def __init__(
        self,
        context_lens: list[int],
        query_lens: list[int],
        page_size: int = 16,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 16,
        seed: int = 0,
        page_major: bool = False,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        pages_per_seq = [-(-c // page_size) for c in context_lens]
        num_pages = sum(pages_per_seq) + 3
        order = list(range(num_pages))
        rng.shuffle(order)  # pages of a sequence are scattered, as in a real pool
        tables: list[list[int]] = []
        for n in pages_per_seq:
            tables.append(order[:n])
            order = order[n:]
        width = max(pages_per_seq)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen)
        self.v_cache = torch.randn(shape, generator=gen)
        tokens = sum(query_lens)
        self.q = torch.randn(tokens, heads, head_dim, generator=gen)
        self.k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        self.v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        slots = [
            table[p // page_size] * page_size + p % page_size
            for table, ctx, q_len in zip(tables, context_lens, query_lens, strict=True)
            for p in range(ctx - q_len, ctx)
        ]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        self.positions = torch.tensor(
            [
                p
                for ctx, q_len in zip(context_lens, query_lens, strict=True)
                for p in range(ctx - q_len, ctx)
            ]
        )
        self.rotary = RotaryEmbedding(head_dim, max(context_lens), 10000.0, None)
        self.page_size = page_size
        self.rotary.to(DEVICE)
        for name in ("k_cache", "v_cache", "q", "k", "v", "positions"):
            setattr(self, name, getattr(self, name).to(DEVICE))
        block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
        )
        if page_major:  # a graphed step's layout: strides (1, seqs)
            block_tables = block_tables.t().contiguous().t()
        self.meta = AttentionMetadata(
            query_lens=query_lens,
            context_lens=context_lens,
            slot_mapping=torch.tensor(slots, device=DEVICE),
            block_tables=block_tables,
            seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            decode_only=all(n == 1 for n in query_lens),
        )

    def prepared(self, backend) -> AttentionMetadata:
        """A copy of the step's metadata after `backend.prepare` (which writes derived fields)."""
        meta = AttentionMetadata(**{**self.meta.__dict__})
        backend.prepare(meta)
        return meta

    def run(
        self, backend, layer: LayerAttention = FULL, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, k_cache, v_cache) after the backend ran on fresh copies of the cache."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        meta = self.prepared(backend)
        cache = (k_cache, v_cache)
        out = backend.forward(
            self.q, self.k, self.v, self.positions, self.rotary, cache, meta, layer, sinks
        )
        return out, k_cache, v_cache

    def rotated(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated at their positions by the torch reference (engine/layers/rope.py)."""
        return self.rotary(self.positions, self.q, self.k)


def reference(
    step: Step,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: LayerAttention = FULL,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's queries against its keys read page by page from the written cache, in
    float64: scale 0.25 unless the layer has its own; a window, a cap and sinks as transformers'
    eager attention applies them."""
    scale = 0.25 if layer.scale is None else layer.scale
    meta = step.meta
    assert meta.block_tables is not None
    page_size = step.page_size
    rotated_q = step.rotated()[0]
    outs = []
    start = 0
    for seq, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        table = meta.block_tables[seq, : -(-ctx // page_size)].long()
        keys = k_cache[table].flatten(0, 1)[:ctx].double()  # [ctx, kv_heads, dim]
        values = v_cache[table].flatten(0, 1)[:ctx].double()
        q = rotated_q[start : start + q_len].double()  # [q_len, heads, dim]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if layer.softcap is not None:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        query_pos, key_pos = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
        visible = key_pos <= query_pos
        if layer.sliding_window is not None:
            visible &= key_pos > query_pos - layer.sliding_window
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += q_len
    return torch.cat(outs).float()


def hide_passed_pages(step: Step, window: int) -> int:
    """Point each table entry of a page that none of its sequence's queries can see through
    `window` at one new page of NaN, as the KV cache does with the pages a sliding window has
    passed: a kernel that reads one returns NaN. Returns how many entries now point there.
    (Compute the reference first: it reads every page it masks.)"""
    meta = step.meta
    assert meta.block_tables is not None
    scratch = step.k_cache.shape[0]
    nan_page = torch.full_like(step.k_cache[:1], float("nan"))
    step.k_cache = torch.cat([step.k_cache, nan_page])
    step.v_cache = torch.cat([step.v_cache, nan_page])
    hidden = 0
    for seq, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        first_seen = max(0, ctx - q_len - window + 1)  # the first query's first key
        for page in range(first_seen // step.page_size):
            meta.block_tables[seq, page] = scratch
            hidden += 1
    return hidden
