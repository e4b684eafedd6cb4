"""The reference attention backend: gather a sequence's pages, run SDPA. Any device.

The packed batch is a list of sequences, each contributing `query_len` new tokens whose keys
and values are written into the paged cache first; each query attends causally to its
sequence's whole context (cached prefix + new tokens). Decode rows (one query each) are
batched into one padded SDPA call; prefill rows run one SDPA call each.

With no KV cache (training, or a forward without serving state) every sequence starts at
position 0 and attends only to its own new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step and read by every layer.

    Host lists describe the batch; tensors live on the model's device.
    """

    query_lens: list[int]  # new tokens per sequence, packed in this order
    context_lens: list[int]  # KV length per sequence after this step (prefix + new)
    slot_mapping: torch.Tensor | None  # [tokens] cache slot (page * page_size + offset)
    block_tables: torch.Tensor | None  # [seqs, max_pages] page ids, padded with 0
    # Derived once per step by prepare(); read by every layer.
    decode_rows: torch.Tensor | None = None  # [decodes] token index of each decode row
    decode_tables: torch.Tensor | None = None  # [decodes, max_pages]
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_context] True = attend
    prefill_seqs: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (sequence index, first token index, query_len, context_len) of each prefill row

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def prepare(meta: AttentionMetadata, page_size: int, device: torch.device) -> AttentionMetadata:
    """Split the batch into batched decode rows and per-sequence prefill rows."""
    starts = [0]
    for n in meta.query_lens[:-1]:
        starts.append(starts[-1] + n)
    has_cache = meta.block_tables is not None
    decodes = [i for i, n in enumerate(meta.query_lens) if n == 1 and has_cache]
    decode_set = set(decodes)
    meta.prefill_seqs = [
        (i, starts[i], meta.query_lens[i], meta.context_lens[i])
        for i in range(len(meta.query_lens))
        if i not in decode_set
    ]
    if decodes and meta.block_tables is not None:
        max_context = max(meta.context_lens[i] for i in decodes)
        pages = -(-max_context // page_size)
        index = torch.tensor(decodes, device=device)
        meta.decode_rows = torch.tensor([starts[i] for i in decodes], device=device)
        meta.decode_tables = meta.block_tables[index, :pages]
        lens = torch.tensor([meta.context_lens[i] for i in decodes], device=device)
        positions = torch.arange(pages * page_size, device=device)
        meta.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
    return meta


class TorchRefAttention:
    """Paged attention with torch ops only: the correctness reference."""

    name = "torch_ref"

    def __init__(self, scale: float) -> None:
        self.scale = scale

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
        k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = k
        v_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = v

        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            assert meta.decode_tables is not None
            rows = meta.decode_rows
            n = rows.shape[0]
            keys = k_cache[meta.decode_tables].view(n, -1, kv_heads, head_dim).transpose(1, 2)
            values = v_cache[meta.decode_tables].view(n, -1, kv_heads, head_dim).transpose(1, 2)
            out[rows] = self._sdpa(q[rows].unsqueeze(2), keys, values, meta.decode_mask).squeeze(2)
        for seq, start, q_len, ctx_len in meta.prefill_seqs:
            table = meta.block_tables[seq, : -(-ctx_len // k_cache.shape[1])]
            keys = k_cache[table].view(-1, kv_heads, head_dim)[:ctx_len]
            values = v_cache[table].view(-1, kv_heads, head_dim)[:ctx_len]
            out[start : start + q_len] = self._causal(q[start : start + q_len], keys, values)
        return out

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
