"""The cpu backend's C kernels (cpu_attention.c), built and loaded by engine/layers/native.py:
paged decode attention (with a layer's window, scale, soft cap and sinks), and the rotary
embedding with the KV write.

torch has no paged attention on the CPU: the reference backend gathers each row's pages and
runs SDPA, whose kernel with one query row is far from the memory bandwidth that decode
attention is bound by. This kernel reads the pages in place.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.layers import native
from engine.layers.native import DTYPES

SOURCE = Path(__file__).with_name("cpu_attention.c")


def load() -> ctypes.CDLL | None:
    """The kernel library with its signature declared, or None when it cannot be built here."""
    lib = native.load(SOURCE)
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]  # dtype .. out
        fn.argtypes += [i64] * 6 + [ctypes.c_float, ctypes.c_int32, ctypes.c_float]  # .. softcap
        fn.argtypes += [ptr, ctypes.c_int]  # sinks, threads
        lib.rotary_store.restype = None
        lib.rotary_store.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, i64]  # .. v_stride
        lib.rotary_store.argtypes += [ptr] * 8 + [i64] * 5 + [ctypes.c_int]  # positions ..
    return lib


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [rows, width] int32
    lens: torch.Tensor,  # [rows] int32, each >= 1
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [heads]
) -> torch.Tensor:  # [rows, heads, head_dim]
    """Each row's query (at position lens - 1) against its keys: the last `window` of them
    when given (table entries of pages wholly before the window are never read), scores
    capped at `softcap`, each head's sink one more logit of its softmax."""
    rows, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    # Pages may lie further apart than a page's elements (a smaller layer's view into storage
    # shared with a larger one: engine/kv_cache/kv_groups.py); within a page, tokens are dense.
    page_stride = k_cache.stride(0)
    for cache in (k_cache, v_cache):
        assert cache.stride(0) == page_stride and cache[0].is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype and tables.dtype == lens.dtype == torch.int32
    if tables.stride(1) != 1:  # a page-major table (graph steps build those)
        tables = tables.contiguous()
    lens = lens.contiguous()
    assert window is None or window >= 1
    if sinks is not None:
        assert sinks.shape == (heads,)
        sinks = sinks.detach().to(torch.float32).contiguous()
    out = torch.empty(rows, heads, head_dim, dtype=q.dtype)
    status = lib.paged_decode_attention(
        DTYPES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        kv_heads,
        head_dim,
        page_size,
        page_stride,
        scale,
        window or 0,
        softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("cpu decode attention: out of memory for its work buffers")
    return out


def rotary_store(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    positions: torch.Tensor,  # [tokens] int64
    cos: torch.Tensor,  # [max positions, rotary_dim] float32: the leading dims that rotate
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [tokens] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # q and k rotated, contiguous
    tokens, heads, head_dim = q.shape
    rotary_dim = cos.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    kv_heads = k.shape[1]
    q, k, v = (
        t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous() for t in (q, k, v)
    )
    assert q.dtype == k.dtype == v.dtype == k_cache.dtype and cos.dtype == torch.float32
    assert positions.dtype == slots.dtype == torch.int64 and cos.is_contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    lib.rotary_store(
        DTYPES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        positions.contiguous().data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.contiguous().data_ptr(),
        tokens,
        heads,
        kv_heads,
        head_dim,
        rotary_dim,
        torch.get_num_threads(),
    )
    return q_out, k_out
