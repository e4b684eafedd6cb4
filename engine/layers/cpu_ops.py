"""RMSNorm (with its residual add) and SiLU-and-mul on the CPU in C (cpu_ops.c), one call each
instead of torch's 5-9 small ops.

`usable(x)` says when they run: CPU inference (no autograd recording) in float32 or bfloat16,
with the library built (engine/layers/native.py); else the layers keep their torch code. The
contracts are rms_norm_ref's and silu_and_mul_ref's, and the results equal them but for the
order of the variance's sum (tests/engine/layers/test_cpu_ops.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.layers import native
from engine.layers.native import DTYPES

SOURCE = Path(__file__).with_name("cpu_ops.c")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load(SOURCE)
    if lib is not None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.rms_norm.restype = lib.silu_and_mul.restype = None
        lib.rms_norm.argtypes = [i32, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64]
        lib.rms_norm.argtypes += [ctypes.c_float, i32]
        lib.silu_and_mul.argtypes = [i32, ptr, ptr, i64, ptr, i64, i64, i32]
    return lib


def usable(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and not torch.is_grad_enabled()
        and _lib() is not None
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a contiguous last dim (a view where one exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's contract: (normalised x + residual, x + residual), new tensors."""
    lib = _lib()
    assert lib is not None and weight.dtype == x.dtype and weight.is_contiguous()
    x2 = _rows(x)
    rows, dim = x2.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is None:
        lib.rms_norm(
            DTYPES[x.dtype],
            x2.data_ptr(),
            x2.stride(0),
            None,
            0,
            weight.data_ptr(),
            out.data_ptr(),
            None,
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out, x
    r2 = _rows(residual)
    stream = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm(
        DTYPES[x.dtype],
        x2.data_ptr(),
        x2.stride(0),
        r2.data_ptr(),
        r2.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        stream.data_ptr(),
        rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    return out, stream


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [tokens, inter]; gate and up may be two column halves of one tensor."""
    lib = _lib()
    assert lib is not None and gate.shape == up.shape and gate.dtype == up.dtype
    gate2, up2 = _rows(gate), _rows(up)
    if gate2.stride(0) != up2.stride(0):
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    rows, dim = gate2.shape
    out = torch.empty(gate.shape, dtype=gate.dtype)
    lib.silu_and_mul(
        DTYPES[gate.dtype],
        gate2.data_ptr(),
        up2.data_ptr(),
        gate2.stride(0),
        out.data_ptr(),
        rows,
        dim,
        torch.get_num_threads(),
    )
    return out
