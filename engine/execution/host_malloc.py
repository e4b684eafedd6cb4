"""glibc's malloc for a CPU engine: freed memory stays in the process for the next step.

A CPU step allocates its activations anew, up to tens of MB each (a 2048-token prefill's MLP
output is 32 MB in float32). glibc serves an allocation above its mmap threshold (32 MB at
most) with a fresh mmap that free() unmaps at once, and trims the free top of its heap back to
the system: the next step's buffers are new pages, each first written through a page fault,
which a VM makes dearer still. On a 2-core VM the float32 prefill of bench/offline's workload
(64 prompts, 8,537 tokens) took 3.6-6.0 s that way and 3.2-3.4 s with every allocation from
the heap and no trimming, as with tcmalloc (3.2-3.3 s), which vLLM's CPU guide preloads.

`keep_freed_memory` sets glibc so (M_MMAP_MAX 0, M_TRIM_THRESHOLD at its maximum) for the whole
process: the heap then stays at its peak, as a caching allocator does, until `malloc_trim`
returns its free pages (a sleep calls it: engine/sleep/model_memory.py). Not glibc (musl,
macOS): nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process; True where glibc took the settings."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    # NOTE: the mmap count first: an allocation between the two calls may otherwise be mapped.
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
