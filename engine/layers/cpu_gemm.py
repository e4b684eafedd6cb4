"""bfloat16 linear layers of few rows on Intel AMX (cpu_gemm.c), for CPU decode steps.

A decode step multiplies a few rows by every weight, so its GEMMs are bound by reading the
weights. On weights packed once into AMX tiles, cpu_gemm.c runs llama-75m's linear layers
1.0-1.3x as fast as oneDNN's bfloat16 GEMM on its own packed weights from 1 to 96 rows
(bench/cpu/linear.py, docs/benchmarks.md); from about 128 rows on (prefill) oneDNN is as fast
or faster, and `usable` leaves those to it.

It runs where the CPU has AMX-BF16 (and the kernel library built with it: engine/layers/native.py
compiles for this CPU) and the process was granted AMX's tile state; elsewhere `usable` is
False and linear.py keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.layers import native

SOURCE = Path(__file__).with_name("cpu_gemm.c")
MAX_ROWS = 96  # above it oneDNN is as fast or faster (128 rows: 0.96-1.03x, 256: 0.70-0.74x)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load(SOURCE)
    if lib is None or not lib.amx_enable():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_linear.restype = None
    lib.amx_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
    lib.amx_linear.argtypes += [ctypes.c_int]
    return lib


def runs(dtype: torch.dtype) -> bool:
    """Whether this machine runs `dtype`'s GEMMs here (for some row counts)."""
    return dtype == torch.bfloat16 and _lib() is not None


def usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` runs this product: bfloat16 on the CPU, at most MAX_ROWS rows, AMX."""
    return (
        x.dtype == weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and _lib() is not None
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> cpu_gemm.c's tiles [NB, KC, 16, 16, 2]: 16-column blocks (NB even),
    32 K values each, as pairs; zero-padded (zeros add nothing to the sums)."""
    n, k = weight.shape
    blocks, chunks = -(-n // 32) * 2, -(-k // 32)
    padded = weight.new_zeros(blocks * 16, chunks * 32)
    padded[:n, :k] = weight
    return padded.view(blocks, 16, chunks, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out_float32: bool = False,
) -> torch.Tensor:
    """x [..., K] @ W^T + bias in bfloat16; `packed` is `pack(W)`, W [out_features, K].
    `out_float32`: the same values as float32 (as `.float()` of the result would give)."""
    lib = _lib()
    assert lib is not None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    dtype = torch.float32 if out_float32 else torch.bfloat16
    out = torch.empty(*x.shape[:-1], out_features, dtype=dtype)
    if rows.shape[0] == 0:
        return out
    lib.amx_linear(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        rows.shape[1],
        packed.data_ptr(),
        out_features,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out_features,
        int(out_float32),
        torch.get_num_threads(),
    )
    return out
