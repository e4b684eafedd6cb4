"""engine/execution/host_malloc.py: after keep_freed_memory, a large CPU tensor comes from
glibc's heap, not a fresh mmap, and freed ones serve the next; without it, glibc maps each.
Each case runs in a fresh interpreter: the setting is process-wide. glibc only (Linux)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROBE = """
import ctypes, sys, torch
from engine.execution.host_malloc import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "keep":
    assert keep_freed_memory()
mapped = libc.mallinfo2().hblkhd
first = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, above any mmap threshold
mapped = libc.mallinfo2().hblkhd - mapped
del first
for _ in range(2):  # the heap settles: an aligned allocation leaves its edges apart
    step = torch.ones(64 << 20, dtype=torch.uint8)
    del step
heap = libc.mallinfo2().arena
for _ in range(3):
    step = torch.ones(64 << 20, dtype=torch.uint8)
    del step
print(mapped, libc.mallinfo2().arena - heap)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def probe(mode: str) -> tuple[int, int]:
    """(bytes glibc mapped for a 64 MiB tensor, bytes its heap grew over three more once
    settled)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_kept_memory_comes_from_the_heap_and_serves_the_next_buffer() -> None:
    mapped, grown = probe("keep")
    assert mapped == 0
    assert grown == 0  # each freed buffer held the next


def test_without_it_glibc_maps_each_large_buffer() -> None:
    mapped, _ = probe("default")
    assert mapped >= 64 << 20
