"""The reference attention backend: gather a sequence's pages, run SDPA. Any device.

The packed batch is a list of sequences, each contributing `query_len` new tokens whose keys
and values are written into the paged cache first; each query attends causally to its
sequence's whole context (cached prefix + new tokens). Decode rows (one query each) are
batched into one padded SDPA call; prefill rows run one SDPA call each.

A decode-only step reads only tensors and the step's constant ints, so it can be captured in
a CUDA graph. With no KV cache (training, or a forward without serving state) every sequence
starts at position 0 and attends only to its own new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "TorchRefAttention"]


class TorchRefAttention:
    """Paged attention with torch ops only: the correctness reference."""

    name = "torch_ref"

    def __init__(self, scale: float, page_size: int | None = None) -> None:
        self.scale = scale
        self.page_size = page_size  # None: dense (no KV cache) forwards only

    def prepare(self, meta: AttentionMetadata) -> None:
        """Split the batch into batched decode rows and per-sequence prefill rows, once a step."""
        if meta.block_tables is None:
            return
        assert self.page_size is not None, "a paged forward needs the backend's page_size"
        pages = -(-meta.max_context_len // self.page_size)
        if meta.decode_only:
            assert meta.seq_lens is not None
            meta.decode_rows = None  # every row
            self._decode_view(meta, meta.block_tables, meta.seq_lens, pages)
            return
        device = meta.block_tables.device
        starts = [0]
        for n in meta.query_lens[:-1]:
            starts.append(starts[-1] + n)
        decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
        decode_set = set(decodes)
        meta.prefill_seqs = [
            (i, starts[i], meta.query_lens[i], meta.context_lens[i])
            for i in range(meta.num_seqs)
            if i not in decode_set
        ]
        if decodes:
            pages = -(-max(meta.context_lens[i] for i in decodes) // self.page_size)
            index = torch.tensor(decodes, device=device)
            meta.decode_rows = torch.tensor([starts[i] for i in decodes], device=device)
            lens = torch.tensor([meta.context_lens[i] for i in decodes], device=device)
            self._decode_view(meta, meta.block_tables[index], lens, pages)

    def _decode_view(
        self, meta: AttentionMetadata, tables: torch.Tensor, lens: torch.Tensor, pages: int
    ) -> None:
        assert self.page_size is not None
        meta.decode_tables = tables[:, :pages]
        positions = torch.arange(pages * self.page_size, device=tables.device)
        meta.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,  # [pages, page_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [tokens, heads, head_dim]
        if cache is None:
            return self._dense(q, k, v, meta)
        k_cache, v_cache = cache
        assert meta.slot_mapping is not None and meta.block_tables is not None
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        if meta.decode_only:
            return self._decode(q, k_cache, v_cache, meta)

        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            out[rows] = self._decode(q[rows], k_cache, v_cache, meta)
        for seq, start, q_len, ctx_len in meta.prefill_seqs:
            table = meta.block_tables[seq, : -(-ctx_len // k_cache.shape[1])]
            keys = k_cache.index_select(0, table).view(-1, kv_heads, head_dim)[:ctx_len]
            values = v_cache.index_select(0, table).view(-1, kv_heads, head_dim)[:ctx_len]
            out[start : start + q_len] = self._causal(q[start : start + q_len], keys, values)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per row against its gathered pages, masked past its context."""
        assert meta.decode_tables is not None
        n, (kv_heads, head_dim) = q.shape[0], k_cache.shape[2:]
        pages = meta.decode_tables.flatten()  # index_select: several times faster than k[t]
        keys = k_cache.index_select(0, pages).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, pages).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        return self._sdpa(q.unsqueeze(2), keys, values, meta.decode_mask).squeeze(2)

    def _dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        outs = []
        start = 0
        for q_len in meta.query_lens:
            end = start + q_len
            outs.append(self._causal(q[start:end], k[start:end], v[start:end]))
            start = end
        return torch.cat(outs)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [q_len, heads, dim] are the last q_len positions of k/v [ctx, kv_heads, dim]."""
        q_len, ctx_len = q.shape[0], k.shape[0]
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if q_len == ctx_len:
            out = F.scaled_dot_product_attention(
                q4, k4, v4, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(ctx_len, device=q.device)[None, :]
            out = self._sdpa(q4, k4, v4, mask)
        return out.squeeze(0).transpose(0, 1)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q [batch, heads, q_len, dim]; k, v [batch, kv_heads, ctx, dim]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
