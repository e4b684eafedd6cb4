"""The CPU decode-attention kernel (cpu_decode.c): built with the system's C compiler on first
use, cached, loaded with ctypes.

torch has no paged attention on the CPU: the reference backend gathers each row's pages and
runs SDPA, whose kernel with one query row is far from the memory bandwidth that decode
attention is bound by. This kernel reads the pages in place. It is plain C with no torch
headers, so it builds in about a second; the shared library is cached under
`$SLUICE_KERNEL_CACHE` (default `~/.cache/sluice/kernels`), keyed by the source, the compiler
and this CPU's flags (`-march=native`). Without a compiler (or if the build fails) `load()`
returns None and the engine keeps the reference path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math"]
FLAGS += ["-fno-strict-aliasing", "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype codes


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "sluice" / "kernels"
    return Path(os.environ.get("SLUICE_KERNEL_CACHE", default))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str, target: Path) -> None:
    """Compile, then link without -ffast-math (which would set flush-to-zero process-wide)."""
    with tempfile.TemporaryDirectory() as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        subprocess.run([compiler, *FLAGS, "-c", str(SOURCE), "-o", str(obj)], check=True)
        subprocess.run(
            [compiler, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"], check=True
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(lib, target)  # atomic: concurrent builders each install a whole library


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None when it cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"cpu_decode-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError):
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]  # dtype .. out
    fn.argtypes += [i64] * 5 + [ctypes.c_float, ctypes.c_int]  # rows .. page_size, scale, threads
    return lib


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [rows, width] int32
    lens: torch.Tensor,  # [rows] int32, each >= 1
    scale: float,
) -> torch.Tensor:  # [rows, heads, head_dim]
    rows, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype and tables.dtype == lens.dtype == torch.int32
    if tables.stride(1) != 1:  # a page-major table (graph steps build those)
        tables = tables.contiguous()
    lens = lens.contiguous()
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
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("cpu decode attention: out of memory for its work buffers")
    return out
