"""glibc's malloc for a CPU engine: freed memory stays in the process for the next step.

A CPU step allocates its activations anew, up to tens of MB each (a 2048-token prefill's MLP
output is 32 MB in float32). glibc serves an allocation above its mmap threshold (32 MB at
most) with a fresh mmap that free() unmaps at once, and trims the free top of its heap back to
the system: the next step's buffers are new pages, each first written through a page fault,
which a VM makes dearer still. On a 2-core VM the float32 prefill of bench.throughput.offline's
workload (64 prompts, 8,537 tokens) took 3.6-6.0 s that way and 3.2-3.4 s with every allocation
from the heap and no trimming, as with tcmalloc (3.2-3.3 s), which vLLM's CPU guide preloads.

`keep_freed_memory` sets glibc so (M_MMAP_MAX 0, M_TRIM_THRESHOLD at its maximum) for the whole
process: the heap then stays at its peak, as a caching allocator does. Not glibc (musl,
macOS): nothing changes.

The long-lived buffers a sleep frees (the KV pool, the weights and their packed copies) must
not live in that heap: freed there, they leave a hole that only `malloc_trim` can hand back,
page by page (the address space stays, and a later allocation may split the hole so that the
wake's pool no longer fits in it and the heap grows). So they are allocated inside
`mapped_allocations()`, where glibc maps each allocation of MAPPED_MIN_BYTES or more anew:
freeing one unmaps it, and a sleep returns exactly its bytes (engine/sleep/model_memory.py).
Per-step buffers never come from there, so the decode speed the heap bought is kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable, Iterator

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_MAX_DEFAULT = 65536  # glibc's own default count of mapped chunks
MAPPED_MIN_BYTES = 1 << 20  # inside mapped_allocations: smaller ones still come from the heap

_mapped_depth = 0  # nested mapped_allocations() windows open on any thread


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    return getattr(ctypes.CDLL(name), "mallopt", None) if name else None


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process; True where glibc took the settings."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # NOTE: the mmap count first: an allocation between the two calls may otherwise be mapped.
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


@contextlib.contextmanager
def mapped_allocations(device_type: str) -> Iterator[None]:
    """Within: every allocation of MAPPED_MIN_BYTES or more (on any thread) is a mapping of its
    own, which free() unmaps. For the buffers of a CPU engine (`device_type` "cpu", which keeps
    freed memory: this calls `keep_freed_memory`) that live until a sleep frees them. Nothing
    changes for another device, nor where glibc's settings did not take."""
    global _mapped_depth
    mallopt = _mallopt()
    if device_type != "cpu" or mallopt is None or not keep_freed_memory():
        yield
        return
    if _mapped_depth == 0:
        # NOTE: the threshold first: the count opens the window at whatever threshold is set.
        mallopt(M_MMAP_THRESHOLD, MAPPED_MIN_BYTES)
        mallopt(M_MMAP_MAX, MMAP_MAX_DEFAULT)
    _mapped_depth += 1
    try:
        yield
    finally:
        _mapped_depth -= 1
        if _mapped_depth == 0:
            mallopt(M_MMAP_MAX, 0)
