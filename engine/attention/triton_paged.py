"""Paged attention in Triton: the fast backend on CUDA.

Kernels over the PagePool layout (per layer: [pages, page_size, kv_heads, head_dim],
contiguous):
- engine/layers/rotary_kv.py's kernel first: rotary on q and k, and each new token's K and V
  into its cache slot (`meta.slot_mapping`).
- decode (every sequence feeds one token): `_decode_split` gives each (sequence, KV head,
  split) program one slice of the context and all the query heads that share the KV head
  (GQA), with an online softmax; `_decode_reduce` merges the splits by their log-sum-exp.
  With one split (a large batch fills the device without splitting) `_decode_split` writes
  the output itself and there is no reduce launch. The split count depends only on the
  batch size, so a captured graph and an eager step of the same size compute the same thing.
- `_prefill`: ragged packed queries (`meta.query_start_loc`), each attending causally to its
  sequence's whole context through the page table, so a prefill over a cached prefix, a
  chunk of a long prompt and a decode row in a mixed step are all the same case. A program
  takes BLOCK_Q query tokens times the GQA group as the rows of one tile.

Only long-standing `tl` APIs (the H200 machine runs Triton 3.6). The kernels also run under
Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from engine.attention.backend import FULL, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchRefAttention
from engine.layers.kernel_choice import interpreting
from engine.layers.rotary_kv import rotary_kv

if TYPE_CHECKING:
    from engine.layers.rope import RotaryEmbedding

__all__ = ["TritonPagedAttention", "interpreting"]

LOG2E = math.log2(math.e)
MAX_SPLITS = 16
DECODE_BLOCK_N = 64  # context tokens per decode iteration
PREFILL_BLOCK_M = 64  # query rows (tokens x group heads) per prefill program
PREFILL_BLOCK_N = 64


@triton.jit
def _decode_split(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,  # [seqs, heads, splits, head_dim] float32; with one split, the output
    part_lse_ptr,  # [seqs, heads, splits] float32, log2 units; unused with one split
    stride_q_tok,
    stride_q_head,
    stride_o_tok,  # the output's strides, read with one split only
    stride_o_head,
    stride_bt,
    stride_bt_page,  # 1 for a row-major table; graphed steps use a page-major one
    NUM_HEADS: tl.constexpr,
    SCALE_LOG2: tl.constexpr,  # per model; torch.compile would pass a float argument as fp64
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # ieee for float32 (exact vs torch); ignored for bf16
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    h_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_off = seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        bt_off = seq * stride_bt + (pos // PAGE_SIZE) * stride_bt_page
        page = tl.load(block_tables_ptr + bt_off, mask=p_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_off = slot[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * SCALE_LOG2  # [BLOCK_H, BLOCK_N]
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # An empty split (short context) leaves denom = 0: log-sum-exp -inf, weight 0 when merged.
    safe_l = tl.maximum(denom, 1e-30)
    out_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:  # the whole context in this program: the output itself, no reduce
        o_off = seq * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
        out = acc / safe_l[:, None]
        tl.store(part_out_ptr + o_off, out.to(part_out_ptr.dtype.element_ty), out_mask)
    else:
        lse = tl.where(denom > 0, m + tl.log2(safe_l), float("-inf"))
        part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / safe_l[:, None], out_mask
        )
        tl.store(part_lse_ptr + part, lse, mask=h_mask)


@triton.jit
def _decode_reduce(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # every sequence has one non-empty split
    weight = weight / tl.sum(weight, 0)
    parts_off = (base + s)[:, None] * HEAD_DIM + d[None, :]
    parts = tl.load(part_out_ptr + parts_off, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0)
    out_off = seq * stride_o_tok + head * stride_o_head + d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_bt_page,  # 1 for a row-major table; graphed steps use a page-major one
    SCALE_LOG2: tl.constexpr,  # per model; torch.compile would pass a float argument as fp64
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,  # BLOCK_Q * BLOCK_G rows: (token, head of the group)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # ieee for float32 (exact vs torch); ignored for bf16
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)
    prefix = ctx_len - q_len  # tokens of KV before this step's

    r = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    row_mask = (tok < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_off = (q_start + tok)[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + tok

    # Causal: this block's last query sees up to its own position; a block past the
    # sequence's queries reads nothing (and stores nothing).
    kv_end = tl.minimum(ctx_len, prefix + (q_block + 1) * BLOCK_Q)
    kv_end = tl.where(q_block * BLOCK_Q < q_len, kv_end, 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < kv_end
        bt_off = seq * stride_bt + (pos // PAGE_SIZE) * stride_bt_page
        page = tl.load(block_tables_ptr + bt_off, mask=p_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_off = slot[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * SCALE_LOG2  # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Every row sees position 0 in the first block, so m is finite from then on.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.maximum(denom, 1e-30)[:, None]
    o_off = (q_start + tok)[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), row_mask[:, None] & d_mask[None, :])


class TritonPagedAttention:
    """The AttentionBackend of Triton kernels; same contract as TorchRefAttention."""

    name = "triton"

    def __init__(self, scale: float, page_size: int, num_programs: int = 264) -> None:
        self.scale = scale
        self.page_size = page_size
        self.num_programs = num_programs  # decode programs to aim for (about 2 per SM)
        self._dense = TorchRefAttention(scale, page_size)  # no-cache forwards only

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to derive: the kernels read the metadata's tensors directly."""

    def num_splits(self, num_seqs: int, kv_heads: int) -> int:
        """KV splits of a decode step: enough programs to fill the device. A function of the
        batch size only, so graphs and eager steps of one size agree."""
        wanted = -(-self.num_programs // (num_seqs * kv_heads))
        return min(MAX_SPLITS, triton.next_power_of_2(wanted))

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [tokens, heads, head_dim]
        if cache is None:
            return self._dense.forward(q, k, v, positions, rotary, None, meta, layer, sinks)
        if not layer.plain or sinks is not None:
            raise NotImplementedError("triton attention: sliding windows, scales, caps, sinks")
        meta = meta.for_cache(cache)  # the layer's KV group's tables
        k_cache, v_cache = cache
        assert meta.slot_mapping is not None and meta.block_tables is not None
        assert meta.seq_lens is not None and meta.query_start_loc is not None
        # One kernel: rotary on q and k, K and V into the cache (engine/layers/rotary_kv.py).
        q = rotary_kv(
            q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping
        )
        out = torch.empty_like(q)
        if meta.decode_only:
            self._decode(q, k_cache, v_cache, out, meta)
        else:
            self._prefill(q, k_cache, v_cache, out, meta)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        assert meta.block_tables is not None and meta.seq_lens is not None
        num_seqs, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        splits = self.num_splits(num_seqs, kv_heads)
        block_d = _block_d(head_dim)
        part_out, part_lse = out, out  # one split writes the output directly
        if splits > 1:
            part_out = torch.empty(
                (num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
            )
            part_lse = torch.empty(
                (num_seqs, num_heads, splits), dtype=torch.float32, device=q.device
            )
        _decode_split[(num_seqs, kv_heads, splits)](
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, part_out, part_lse,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            meta.block_tables.stride(0), meta.block_tables.stride(1),
            NUM_HEADS=num_heads, SCALE_LOG2=self.scale * LOG2E, KV_HEADS=kv_heads, GROUP=group,
            HEAD_DIM=head_dim, PAGE_SIZE=self.page_size, NUM_SPLITS=splits,
            BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
            BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, DOT_PRECISION=_dot_precision(q),
        )  # fmt: skip
        if splits == 1:
            return
        _decode_reduce[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=splits,
            BLOCK_S=splits,
            BLOCK_D=block_d,
        )

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        assert meta.block_tables is not None
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        block_g = triton.next_power_of_2(group)
        block_q = max(1, PREFILL_BLOCK_M // block_g)
        grid = (meta.num_seqs, kv_heads, triton.cdiv(meta.max_query_len, block_q))
        _prefill[grid](
            q,
            k_cache,
            v_cache,
            out,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            meta.block_tables.stride(1),
            SCALE_LOG2=self.scale * LOG2E,
            KV_HEADS=kv_heads,
            GROUP=group,
            HEAD_DIM=head_dim,
            PAGE_SIZE=self.page_size,
            BLOCK_Q=block_q,
            BLOCK_G=block_g,
            BLOCK_M=block_q * block_g,
            BLOCK_D=_block_d(head_dim),
            BLOCK_N=PREFILL_BLOCK_N,
            DOT_PRECISION=_dot_precision(q),
        )


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 along every axis


def _dot_precision(q: torch.Tensor) -> str:
    # NOTE: float32 dots default to TF32 on tensor cores; ask for IEEE so a float32 engine
    # matches torch_ref. Half-precision inputs never use the option.
    return "ieee" if q.dtype == torch.float32 else "tf32"
