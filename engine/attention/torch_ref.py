"""The reference attention backend: gather a sequence's pages, run SDPA. Any device.

The packed batch is a list of sequences, each contributing `query_len` new tokens: q and k
are rotated at the tokens' positions (engine/layers/rope.py), the keys and values written into
the paged cache with `index_copy_`, and then each query attends causally to its
sequence's whole context (cached prefix + new tokens). Decode rows (one query each) are
sorted by context length and batched into a few padded SDPA calls (on the CPU in a reduced
precision, two batched GEMMs instead: `_decode_matmul`); prefill rows run one SDPA call each.

A decode-only step reads only tensors and the step's constant ints, so it can be captured in
a CUDA graph. With no KV cache (training, or a forward without serving state) every sequence
starts at position 0 and attends only to its own new tokens.

A layer's LayerAttention (a sliding window, its own scale, soft-capped scores) and learned
sinks are applied as transformers' eager attention applies them: the window is a mask; with a
soft cap or sinks the scores are computed explicitly in float32 (SDPA has neither). A prefill
or decode row of a sliding layer gathers its keys from the first page its window sees, no
earlier (the KV cache may point the table entries of pages a window has passed at a scratch page).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.attention.backend import FULL, LayerAttention
from engine.attention.metadata import AttentionMetadata, DecodeGroup

if TYPE_CHECKING:
    from engine.layers.rope import RotaryEmbedding

__all__ = ["AttentionMetadata", "TorchRefAttention"]

GROUP_ROWS = 16  # decode rows per padded attention call, at least (see _split)


class TorchRefAttention:
    """Paged attention with torch ops only: the correctness reference."""

    name = "torch_ref"

    def __init__(self, scale: float, page_size: int | None = None) -> None:
        self.scale = scale
        self.page_size = page_size  # None: dense (no KV cache) forwards only

    def prepare(self, meta: AttentionMetadata) -> None:
        """Split the batch into decode groups and per-sequence prefill rows, once a step
        (and per KV group: each has its own tables)."""
        for group in [meta, *meta.groups]:
            self._prepare(group)

    def _prepare(self, meta: AttentionMetadata) -> None:
        if meta.block_tables is None:
            return
        assert self.page_size is not None, "a paged forward needs the backend's page_size"
        decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
        # A graphed step has its lengths on the device only: it stays one group.
        groups = self._split(decodes, meta.context_lens) if meta.context_lens else []
        if meta.decode_only and len(groups) <= 1:  # the whole batch in order: no gather, no scatter
            assert meta.seq_lens is not None
            pages = -(-meta.max_context_len // self.page_size)
            meta.decode_groups = [self._group(None, meta.block_tables, meta.seq_lens, pages)]
            return
        device = meta.block_tables.device
        starts = [0]
        for n in meta.query_lens[:-1]:
            starts.append(starts[-1] + n)
        decode_set = set(decodes)
        meta.prefill_seqs = [
            (i, starts[i], meta.query_lens[i], meta.context_lens[i])
            for i in range(meta.num_seqs)
            if i not in decode_set
        ]
        meta.decode_groups = []
        for seqs in groups:
            lens = [meta.context_lens[i] for i in seqs]
            group = self._group(
                torch.tensor([starts[i] for i in seqs], device=device),
                meta.block_tables[torch.tensor(seqs, device=device)],
                torch.tensor(lens, dtype=torch.int32, device=device),
                -(-max(lens) // self.page_size),
            )
            meta.decode_groups.append(group)

    def _split(self, decodes: list[int], context_lens: list[int]) -> list[list[int]]:
        """Decode sequences sorted by context length, in groups of GROUP_ROWS or more.

        One padded call over a batch of mixed lengths reads and scores every row up to the
        longest context; groups of similar lengths waste little (several times faster at 128
        rows of contexts spread over 50..1000). A group that would pad to the same page count
        as the previous one joins it: equal lengths stay one call."""
        assert self.page_size is not None
        order = sorted(decodes, key=context_lens.__getitem__)
        groups: list[list[int]] = []
        for start in range(0, len(order), GROUP_ROWS):
            chunk = order[start : start + GROUP_ROWS]
            pages = -(-context_lens[chunk[-1]] // self.page_size)
            if groups and -(-context_lens[groups[-1][-1]] // self.page_size) == pages:
                groups[-1] += chunk
            else:
                groups.append(chunk)
        return groups

    def _group(
        self, rows: torch.Tensor | None, tables: torch.Tensor, lens: torch.Tensor, pages: int
    ) -> DecodeGroup:
        assert self.page_size is not None
        positions = torch.arange(pages * self.page_size, device=tables.device)
        mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        return DecodeGroup(rows, tables[:, :pages], lens, mask)

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        positions: torch.Tensor,  # [tokens]
        rotary: RotaryEmbedding,
        cache: tuple[torch.Tensor, torch.Tensor] | None,  # [pages, page_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        layer: LayerAttention = FULL,
        sinks: torch.Tensor | None = None,  # [heads]
    ) -> torch.Tensor:  # [tokens, heads, head_dim]
        if cache is None:
            q, k = rotary(positions, q, k)
            return self._dense(q, k, v, meta, layer, sinks)
        meta = meta.for_cache(cache)
        k_cache, v_cache = cache
        assert meta.slot_mapping is not None and meta.block_tables is not None
        q, k = self._rotate_and_store(q, k, v, positions, rotary, cache, meta.slot_mapping)
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].rows is None:
            return self._decode_layer(q, k_cache, v_cache, groups[0], layer, sinks)

        out = torch.empty_like(q)
        for group in groups:
            assert group.rows is not None
            rows = q[group.rows]
            out[group.rows] = self._decode_layer(rows, k_cache, v_cache, group, layer, sinks)
        for seq, start, q_len, ctx_len in meta.prefill_seqs:
            end = start + q_len
            if ctx_len == q_len:  # no cached prefix: the keys are this step's own
                keys, values = k[start:end], v[start:end]
            else:
                keys, values = self._context(cache, meta.block_tables[seq], ctx_len, q_len, layer)
            out[start:end] = self._causal(q[start:end], keys, values, layer, sinks)
        return out

    def _context(
        self,
        cache: tuple[torch.Tensor, torch.Tensor],
        table: torch.Tensor,  # [width] the sequence's page ids
        ctx_len: int,
        q_len: int,
        layer: LayerAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [keys, kv_heads, head_dim] each
        """A prefill row's keys and values gathered from its pages: the last keys of its context,
        from the page that holds its first query's first visible key (the first page without a
        window). A page a window has passed is not read: the KV cache may have pointed its
        table entry at a scratch page."""
        page_size, kv_heads, head_dim = cache[0].shape[1:]
        first_page = 0
        if layer.sliding_window is not None:
            first_page = max(0, ctx_len - q_len - layer.sliding_window + 1) // page_size
        pages = table[first_page : -(-ctx_len // page_size)]
        n = ctx_len - first_page * page_size
        keys, values = (c.index_select(0, pages).view(-1, kv_heads, head_dim)[:n] for c in cache)
        return keys, values

    def _decode_layer(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: DecodeGroup,
        layer: LayerAttention,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """A decode group's rows: the backend's own path for plain layers; torch's, with the
        layer's window, scale, cap and sinks, for the others. A sliding layer's rows gather only
        the pages their window can touch (a page it has passed may be a scratch page)."""
        if layer.plain and sinks is None:
            return self._decode(q, k_cache, v_cache, group)
        n, (page_size, kv_heads, head_dim) = q.shape[0], k_cache.shape[1:]
        lens = group.lens.long()[:, None]  # each row's query sits at lens - 1
        tables, first = group.tables, torch.zeros_like(lens)
        if layer.sliding_window is not None:
            tables, first = self._window_tables(tables, lens, layer.sliding_window, page_size)
        pages = tables.flatten()
        keys = k_cache.index_select(0, pages).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, pages).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        key_pos = first + torch.arange(keys.shape[2], device=q.device)[None, :]  # [n, keys]
        visible = key_pos < lens
        if layer.sliding_window is not None:
            visible &= key_pos > lens - 1 - layer.sliding_window
        out = self._attend(q.unsqueeze(2), keys, values, visible[:, None, None, :], layer, sinks)
        return out.squeeze(2)

    @staticmethod
    def _window_tables(
        tables: torch.Tensor, lens: torch.Tensor, window: int, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's table entries from the page holding its first visible key, as many as a
        window can touch, and that page's first position [rows, 1]. Entries past the table
        repeat its last (their positions are past the row's length: masked). Shapes depend on
        the window and page size only, so a graphed step can run it."""
        span = min(tables.shape[1], -(-window // page_size) + 1)
        first_page = (lens - window).clamp(min=0) // page_size  # [rows, 1]
        index = first_page + torch.arange(span, device=tables.device)[None, :]
        index = index.clamp(max=tables.shape[1] - 1)
        return tables.gather(1, index), first_page * page_size

    def _rotate_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated at their positions; k and v written into the cache at `slots`."""
        q, k = rotary(positions, q, k)
        for new, layer_cache in zip((k, v), cache, strict=True):
            if layer_cache.is_contiguous():
                layer_cache.view(-1, *new.shape[1:]).index_copy_(0, slots, new)
            else:  # a page-strided view (engine/kv_cache/page_pool.py): page and offset
                size = layer_cache.shape[1]
                layer_cache[slots // size, slots % size] = new
        return q, k

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
    ) -> torch.Tensor:
        """One query per row against its gathered pages, masked past its context."""
        n, (kv_heads, head_dim) = q.shape[0], k_cache.shape[2:]
        pages = group.tables.flatten()  # index_select: several times faster than k[t]
        keys = k_cache.index_select(0, pages).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, pages).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        assert group.mask is not None
        if q.device.type == "cpu" and q.dtype != torch.float32:
            return self._decode_matmul(q, keys, values, group.mask)
        return self._sdpa(q.unsqueeze(2), keys, values, group.mask).squeeze(2)

    def _decode_matmul(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Decode attention as two batched GEMMs, each kv head's query heads as the rows of one.

        On the CPU, SDPA with one query row in bfloat16 is 5-14x slower than this (its flash
        kernel blocks over query rows; here there is one). Scores are computed in float32, as a
        flash kernel accumulates them (bfloat16 scores lose about 3 digits); the probabilities
        are rounded to the cache dtype for the value GEMM, as flash kernels do."""
        n, heads, head_dim = q.shape
        kv_heads, ctx = keys.shape[1], keys.shape[2]
        group = heads // kv_heads
        rows = q.reshape(n * kv_heads, group, head_dim).float()
        # NOTE: bmm over contiguous [n * kv_heads, ctx, head_dim] operands, not matmul over the
        # gathered views' strides: matmul on those ran 5.6x slower (same numbers).
        keys = keys.to(torch.float32, memory_format=torch.contiguous_format)
        scores = torch.bmm(rows, keys.view(n * kv_heads, ctx, head_dim).transpose(1, 2))
        scores = scores.mul_(self.scale).view(n, kv_heads, group, ctx)
        scores.masked_fill_(~mask.view(n, 1, 1, ctx), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(n * kv_heads, group, ctx)
        values = values.contiguous().view(n * kv_heads, ctx, head_dim)
        return torch.bmm(probs, values).view(n, heads, head_dim)

    def _dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention = FULL,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        outs = []
        start = 0
        for q_len in meta.query_lens:
            end = start + q_len
            outs.append(self._causal(q[start:end], k[start:end], v[start:end], layer, sinks))
            start = end
        return torch.cat(outs)

    def _causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: LayerAttention = FULL,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [q_len, heads, dim] are the last q_len positions of k/v [ctx, kv_heads, dim]."""
        q_len, ctx_len = q.shape[0], k.shape[0]
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if q_len == ctx_len and layer.plain and sinks is None:
            out = F.scaled_dot_product_attention(
                q4, k4, v4, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            key_pos = torch.arange(ctx_len, device=q.device)[None, :]
            mask = q_pos >= key_pos
            if layer.sliding_window is not None:
                mask &= key_pos > q_pos - layer.sliding_window
            out = self._attend(q4, k4, v4, mask, layer, sinks)
        return out.squeeze(0).transpose(0, 1)

    def _attend(
        self,
        q: torch.Tensor,  # [batch, heads, q_len, dim]
        k: torch.Tensor,  # [batch, kv_heads, ctx, dim]
        v: torch.Tensor,
        mask: torch.Tensor,  # broadcast to [batch, heads, q_len, ctx]; True = attend
        layer: LayerAttention,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Masked attention with the layer's scale; SDPA unless the layer caps its scores or
        has sinks, which transformers' eager attention computes as here: scores in float32,
        capped, masked, the sink logit appended as one more column, softmax, the sink's
        share dropped."""
        scale = self.scale if layer.scale is None else layer.scale
        if layer.softcap is None and sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
        scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
        if layer.softcap is not None:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        return torch.matmul(probs, v).to(q.dtype)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q [batch, heads, q_len, dim]; k, v [batch, kv_heads, ctx, dim]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
