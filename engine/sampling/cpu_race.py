"""The CPU sampler's passes over [rows, vocab] in C (cpu_race.c): the exp weights and the
exponential race, each one loop with no temporaries instead of torch's 15-25 elementwise ops,
and the greedy argmax (torch's CPU argmax reads 8-9x slower than a plain reduction).

Bit for bit what engine/sampling/sampling_math.py's torch code computes (the C is built with
IEEE float32 semantics: native.EXACT_FLAGS), so the torch Sampler picks the same tokens with or
without it (tests/engine/sampling/test_cpu_race.py); used when `usable`, else the torch code.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.layers import native
from engine.sampling.sampling_math import row_hash

SOURCE = Path(__file__).with_name("cpu_race.c")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load(SOURCE, exact=True)
    if lib is not None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.exp_weights.restype = lib.race.restype = lib.noise_table.restype = None
        lib.argmax_rows.restype = None
        lib.argmax_rows.argtypes = [ptr, ptr, i64, i64, i32]
        lib.exp_weights.argtypes = [ptr, ptr, ptr, i64, i64, i32]
        lib.race.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i32]
        lib.noise_table.argtypes = [ptr, ptr, i64, i64]
    return lib


def usable(logits: torch.Tensor) -> bool:
    """float32 [rows, vocab] logits on the CPU, the library built."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and _lib() is not None
    )


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): [rows] int64, the lowest id among equal maxima (NaN the largest)."""
    lib = _lib()
    assert lib is not None
    x = logits.contiguous()
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), out.data_ptr(), rows, vocab, _threads())
    return out


def exp_weights(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """sampling_math.exp_weights(logits - row_max[:, None])."""
    lib = _lib()
    assert lib is not None
    x, m = logits.contiguous(), row_max.contiguous().float()
    rows, vocab = x.shape
    out = torch.empty_like(x)
    lib.exp_weights(x.data_ptr(), m.data_ptr(), out.data_ptr(), rows, vocab, _threads())
    return out


def race(
    weights: torch.Tensor,
    kept: torch.Tensor | None,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    sampled: torch.Tensor,
) -> torch.Tensor:
    """Sampler._race's tokens for the `sampled` rows ([rows] bool; the others' are 0)."""
    lib = _lib()
    assert lib is not None
    w = weights.contiguous()
    rows, vocab = w.shape
    hashes = row_hash(seeds, counters).to(torch.int32).contiguous()  # the same 32 bits
    keep = kept.contiguous().view(torch.uint8) if kept is not None else None
    chosen = sampled.contiguous().view(torch.uint8)
    out = torch.zeros(rows, dtype=torch.int64)
    lib.race(
        w.data_ptr(),
        keep.data_ptr() if keep is not None else None,
        hashes.data_ptr(),
        chosen.data_ptr(),
        out.data_ptr(),
        rows,
        vocab,
        _threads(),
    )
    return out


def noise_table(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """The race's noise, [rows, vocab]: sampling_math.exponential_noise from the C (tests)."""
    lib = _lib()
    assert lib is not None
    hashes = row_hash(seeds, counters).to(torch.int32).contiguous()
    out = torch.empty(len(hashes), vocab)
    lib.noise_table(hashes.data_ptr(), out.data_ptr(), len(hashes), vocab)
    return out


def _threads() -> int:
    return torch.get_num_threads()
