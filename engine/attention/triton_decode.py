"""Decode attention in Triton (every sequence feeds one token): split, then reduce.

`_decode_split` gives each (sequence, KV head, split) program one slice of the keys the row
sees and all the query heads that share the KV head (GQA), with an online softmax;
`_decode_reduce` merges the splits by their log-sum-exp. With one split (a large batch fills
the device without splitting) `_decode_split` writes the output itself and there is no reduce
launch. The split count depends only on the batch size and the layer kind, so a captured graph
and an eager step of the same size compute the same thing.

A sliding layer's row sees keys [max(0, len - WINDOW), len): the splits divide that range and
nothing before it is read, table entries included (the KV cache may point them at a scratch
page). Sinks join the softmax's denominator exactly once: in the reduce when there are splits,
else as the single split's starting max and denominator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_scores import block_d, block_n, dot_precision, layer_scores, load_sinks


@triton.jit
def _decode_split(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [heads]; read only with HAS_SINKS and one split
    part_out_ptr,  # [seqs, heads, splits, head_dim] float32; with one split, the output
    part_lse_ptr,  # [seqs, heads, splits] float32, log2 units; unused with one split
    stride_q_tok,
    stride_q_head,
    stride_o_tok,  # the output's strides, read with one split only
    stride_o_head,
    stride_bt,
    stride_bt_page,  # 1 for a row-major table; graphed steps use a page-major one
    NUM_HEADS: tl.constexpr,
    SCORE_SCALE: tl.constexpr,  # the layer kind: engine/attention/triton_scores.py
    CAP_LOG2: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
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
    # The query at seq_len - 1 sees its last WINDOW keys (a constexpr choice: no branch).
    first = tl.maximum(seq_len - WINDOW, 0) if WINDOW > 0 else seq_len * 0
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    h_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_off = seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    if HAS_SINKS and NUM_SPLITS == 1:  # the sink as the softmax's first column, value 0
        m = load_sinks(sinks_ptr, heads, h_mask)
        denom = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
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
        dots = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = layer_scores(dots, SCORE_SCALE, CAP_LOG2)
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
    sinks_ptr,  # [heads]; read only with HAS_SINKS
    out_ptr,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
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
    top = tl.max(lse, 0)  # every sequence has one non-empty split: finite
    if HAS_SINKS:  # the sink's column joins the denominator here, once
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 units
        top = tl.maximum(top, sink)
        weight = tl.exp2(lse - top)
        weight = weight / (tl.sum(weight, 0) + tl.exp2(sink - top))
    else:
        weight = tl.exp2(lse - top)
        weight = weight / tl.sum(weight, 0)
    parts_off = (base + s)[:, None] * HEAD_DIM + d[None, :]
    parts = tl.load(part_out_ptr + parts_off, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0)
    out_off = seq * stride_o_tok + head * stride_o_head + d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode(
    q: torch.Tensor,  # [seqs, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [seqs, heads, head_dim]
    meta: AttentionMetadata,
    splits: int,
    kind: dict[str, object],  # triton_scores.kind_constants
    sinks: torch.Tensor | None,
) -> None:
    """Launch a decode step's split kernel (and its reduce when `splits` > 1)."""
    assert meta.block_tables is not None and meta.seq_lens is not None
    num_seqs, num_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    sinks_arg = q if sinks is None else sinks  # any pointer: never read without sinks
    part_out, part_lse = out, out  # one split writes the output directly
    if splits > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    _decode_split[(num_seqs, kv_heads, splits)](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, sinks_arg, part_out, part_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), meta.block_tables.stride(1),
        NUM_HEADS=num_heads, **kind, KV_HEADS=kv_heads, GROUP=group,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
        BLOCK_D=block_d(head_dim), BLOCK_N=block_n(head_dim), DOT_PRECISION=dot_precision(q),
    )  # fmt: skip
    if splits == 1:
        return
    _decode_reduce[(num_seqs, num_heads)](
        part_out, part_lse, sinks_arg, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits,
        HAS_SINKS=kind["HAS_SINKS"], BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d(head_dim),
    )  # fmt: skip
