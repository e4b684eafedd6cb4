"""Rotary on q and k, and K and V into the paged KV cache, as one Triton kernel.

The Triton attention backend's first step in every layer. Its torch reference is the
torch_ref backend's: engine/layers/rope.py's `RotaryEmbedding` (q * cos + rotate_half(q) *
sin, the tables cast to the model dtype first) and an `index_copy_` of K and V into the slots
of `meta.slot_mapping`. The cache layout is the PagePool's: per layer [pages, page_size,
kv_heads, head_dim], contiguous, so slot s of head h starts at (s * kv_heads + h) * head_dim.

One program per token: it rotates every query head into a new q (contiguous), rotates every
KV head of k into the cache and copies v beside it. With a partial rotary (the tables narrower
than the head: Phi-4-mini's 0.75) the first ROTARY_DIM dimensions of each head rotate, with
rotate_half within them, and the rest are copied unchanged. q, k and v are read through their
token and head strides: the column views of a fused q/k/v projection need no copy. Each product and
the sum are rounded to the model dtype as torch rounds them, so bf16 matches the reference
too (up to a fused multiply-add on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x1, x2, cos1, cos2, sin1, sin2):
    """(x1, x2) halves -> (x1 * cos - x2 * sin, x2 * cos + x1 * sin), rounded as torch does."""
    dtype = x1.dtype
    a1 = (x1.to(tl.float32) * cos1).to(dtype)
    b1 = (x2.to(tl.float32) * sin1).to(dtype)
    a2 = (x2.to(tl.float32) * cos2).to(dtype)
    b2 = (x1.to(tl.float32) * sin2).to(dtype)
    out1 = (a1.to(tl.float32) - b1.to(tl.float32)).to(dtype)
    out2 = (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _rotary_kv(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,  # [tokens, heads, head_dim] contiguous
    k_cache_ptr,
    v_cache_ptr,
    positions_ptr,
    slot_ptr,
    cos_ptr,  # [max_len, rotary_dim] float32: the two halves of a row are equal
    sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = ROTARY_DIM // 2
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < half
    dtype = q_out_ptr.dtype.element_ty
    # The tables cast to the model dtype first, as the reference does.
    row = pos * ROTARY_DIM
    cos1 = tl.load(cos_ptr + row + d, mask=d_mask).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + half + d, mask=d_mask).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + row + d, mask=d_mask).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + half + d, mask=d_mask).to(dtype).to(tl.float32)

    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < HEADS) & d_mask
    src = q_ptr + token * stride_q_tok + h * stride_q_head + d
    q1, q2 = _rotate(
        tl.load(src, mask=mask), tl.load(src + half, mask=mask), cos1, cos2, sin1, sin2
    )
    dst = q_out_ptr + (token * HEADS + h) * HEAD_DIM + d
    tl.store(dst, q1, mask=mask)
    tl.store(dst + half, q2, mask=mask)

    kh = tl.arange(0, BLOCK_KV)[:, None]
    kv_mask = (kh < KV_HEADS) & d_mask
    src = k_ptr + token * stride_k_tok + kh * stride_k_head + d
    k1, k2 = _rotate(
        tl.load(src, mask=kv_mask), tl.load(src + half, mask=kv_mask), cos1, cos2, sin1, sin2
    )
    cache = (slot * KV_HEADS + kh) * HEAD_DIM + d
    tl.store(k_cache_ptr + cache, k1, mask=kv_mask)
    tl.store(k_cache_ptr + cache + half, k2, mask=kv_mask)

    # Whole heads: v, and the dimensions of q and k a partial rotary leaves as they are.
    e = tl.arange(0, BLOCK_D)[None, :]
    v_mask = (kh < KV_HEADS) & (e < HEAD_DIM)
    cache = (slot * KV_HEADS + kh) * HEAD_DIM + e
    v_src = v_ptr + token * stride_v_tok + kh * stride_v_head + e
    tl.store(v_cache_ptr + cache, tl.load(v_src, mask=v_mask), mask=v_mask)
    if ROTARY_DIM < HEAD_DIM:
        q_pass = (h < HEADS) & (e >= ROTARY_DIM) & (e < HEAD_DIM)
        q_src = q_ptr + token * stride_q_tok + h * stride_q_head + e
        q_dst = q_out_ptr + (token * HEADS + h) * HEAD_DIM + e
        tl.store(q_dst, tl.load(q_src, mask=q_pass), mask=q_pass)
        k_pass = v_mask & (e >= ROTARY_DIM)
        k_src = k_ptr + token * stride_k_tok + kh * stride_k_head + e
        tl.store(k_cache_ptr + cache, tl.load(k_src, mask=k_pass), mask=k_pass)


def rotary_kv(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    positions: torch.Tensor,  # [tokens]
    cos: torch.Tensor,  # [max_len, rotary_dim] float32: the leading dims that rotate
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64
) -> torch.Tensor:  # rotated q, [tokens, heads, head_dim] contiguous
    """Rotate q and k at `positions`; store the rotated k and v at their slots."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1
    rotary_dim = cos.shape[1]
    assert cos.is_contiguous() and sin.is_contiguous() and sin.shape[1] == rotary_dim
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    _rotary_kv[(tokens,)](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        positions,
        slot_mapping,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KV=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return q_out
