"""C kernels for the CPU: built with the system's C compiler on first use, cached, loaded with
ctypes.

torch has nothing for a few CPU paths that measurements say matter (paged decode attention,
the norm and activation of a decode step, whose torch forms are 5-10 small ops each). Those
kernels are plain C with no torch headers, so each builds in about a second; OpenMP is the
runtime torch already loaded (same soname), so their threads are torch's. A built library is
cached under `$SLUICE_KERNEL_CACHE` (default `~/.cache/sluice/kernels`), keyed by the source,
the compiler and this CPU's flags (`-march=native`). Without a compiler (`cc`, or `$CC`), or
if the build fails, `load()` returns None and the callers keep their torch paths.
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

FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math"]
FLAGS += ["-fno-strict-aliasing", "-fPIC"]
# For kernels whose results must equal torch's bit for bit (the sampler's decisions): IEEE
# float32 as written, no reassociation, no fused multiply-add.
EXACT_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-strict-aliasing"]
EXACT_FLAGS += ["-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes (cpu_dtypes.h)
HEADERS = Path(__file__).parent  # cpu_dtypes.h, shared by the kernels


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


def _build(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    """Compile, then link without -ffast-math (which would set flush-to-zero process-wide)."""
    with tempfile.TemporaryDirectory() as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        subprocess.run([compiler, *flags, "-c", str(source), "-o", str(obj)], check=True)
        subprocess.run(
            [compiler, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"], check=True
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(lib, target)  # atomic: concurrent builders each install a whole library


@functools.cache
def load(source: Path, exact: bool = False) -> ctypes.CDLL | None:
    """The library built from `source` (a .c file), or None when it cannot be built here.
    `exact`: with EXACT_FLAGS instead of FLAGS."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    flags = EXACT_FLAGS if exact else FLAGS
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(HEADERS.glob("*.h"))]  # what a source includes
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, *flags, version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    try:
        if not target.exists():
            _build(compiler, flags, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError):
        return None
