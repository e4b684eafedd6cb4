"""Prefill and mixed steps in Triton: ragged packed queries (`meta.query_start_loc`), each
attending causally to its sequence's context through the page table, so a prefill over a
cached prefix, a chunk of a long prompt and a decode row in a mixed step are all the same case.
A program takes BLOCK_Q query tokens times the GQA group as the rows of one tile.

A sliding layer's block of queries reads keys from its first query's window start,
max(0, first - WINDOW + 1), so pages wholly before that are never read (nor their table
entries); each row masks the keys its own window has passed. Sinks start every row's online
softmax as a first column of value zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_scores import block_d, block_n, dot_precision, layer_scores, load_sinks

PREFILL_BLOCK_M = 64  # query rows (tokens x group heads) per program, at head_dim <= 128


@triton.jit
def _prefill(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,  # [heads]; read only with HAS_SINKS
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_bt_page,  # 1 for a row-major table; graphed steps use a page-major one
    SCORE_SCALE: tl.constexpr,  # the layer kind: engine/attention/triton_scores.py
    CAP_LOG2: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
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
    # Rows past the sequence's queries (never stored) see what its last query sees, so every
    # row sees a key in the first block and the running max is finite from then on.
    q_pos = prefix + tl.minimum(tok, q_len - 1)

    # Causal: this block's last query sees up to its own position; a block past the
    # sequence's queries reads nothing (and stores nothing).
    kv_end = tl.minimum(ctx_len, prefix + (q_block + 1) * BLOCK_Q)
    kv_end = tl.where(q_block * BLOCK_Q < q_len, kv_end, 0)
    # The block's first query sees nothing before its window.
    first_seen = tl.maximum(prefix + q_block * BLOCK_Q - WINDOW + 1, 0)
    kv_start = first_seen if WINDOW > 0 else kv_end * 0
    if HAS_SINKS:  # the sink as the softmax's first column, value 0
        m = load_sinks(sinks_ptr, heads, g < GROUP)
        denom = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < kv_end
        bt_off = seq * stride_bt + (pos // PAGE_SIZE) * stride_bt_page
        page = tl.load(block_tables_ptr + bt_off, mask=p_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_off = slot[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        dots = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = layer_scores(dots, SCORE_SCALE, CAP_LOG2)
        visible = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.maximum(denom, 1e-30)[:, None]
    o_off = (q_start + tok)[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), row_mask[:, None] & d_mask[None, :])


def prefill(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [tokens, heads, head_dim]
    meta: AttentionMetadata,
    kind: dict[str, object],  # triton_scores.kind_constants
    sinks: torch.Tensor | None,
) -> None:
    """Launch the ragged prefill kernel over every sequence of the step."""
    assert meta.block_tables is not None
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    block_g = triton.next_power_of_2(group)
    # Fewer rows above head_dim 128, so the accumulator tile stays the size of 128's.
    block_m = max(16, PREFILL_BLOCK_M * 128 // max(128, block_d(head_dim)))
    block_q = max(1, block_m // block_g)
    assert block_q <= block_n(head_dim)  # so every row sees a key in its first block
    grid = (meta.num_seqs, kv_heads, triton.cdiv(meta.max_query_len, block_q))
    _prefill[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        q if sinks is None else sinks,  # any pointer: never read without sinks
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), meta.block_tables.stride(1),
        **kind, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_M=block_q * block_g, BLOCK_D=block_d(head_dim),
        BLOCK_N=block_n(head_dim), DOT_PRECISION=dot_precision(q),
    )  # fmt: skip
