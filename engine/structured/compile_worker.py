"""The compile worker: a process that compiles constraints, one at a time, for the engine.

xgrammar compiles in C++ and cannot be interrupted from a thread; a process can be killed. The
engine's CompilePool (compile_pool.py) starts these with the spawn context and kills one whose
compile runs past the time limit or whose caller left. The worker limits its own address space
(RLIMIT_AS) to what it holds after start-up plus `memory_bytes`, so that a compile that would
need more fails here (MemoryError, or the process dies) instead of in the engine.

On the pipe: first the engine's TokenizerInfo (xgrammar's JSON), then one Constraint at a time;
each answered ("ok", None): it compiles within the bounds, ("error", message naming the field)
or ("memory", message): past the memory limit, after which the engine replaces the worker (a
C++ library that ran out of memory may be left in any state). The compiled grammar itself never
crosses: its JSON costs far more than the compile (compile_pool.py), so the engine compiles an
"ok" constraint again itself.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.parent_death import die_with_parent
from engine.protocol.messages import Constraint
from engine.structured.constraint_error import ConstraintError

READY = "ready"


def worker_main(
    conn: Connection,
    compile_with: Callable[[Any, Constraint], Any],
    memory_bytes: int,
    threads: int,
) -> None:
    """Serve compiles on `conn` until it closes: `compile_with(compiler, constraint)` each."""
    die_with_parent()  # a killed engine leaves no compiler behind
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    _limit_address_space(memory_bytes)
    conn.send(READY)
    while True:
        try:
            constraint = conn.recv()
        except EOFError:
            return
        too_costly = f"{constraint.field}: too costly to compile: needs more than "
        too_costly += f"{memory_bytes >> 20} MiB"
        try:
            compile_with(compiler, constraint)
            conn.send(("ok", None))
        except ConstraintError as exc:  # xgrammar reports its std::bad_alloc as a RuntimeError
            out_of_memory = str(exc).endswith("std::bad_alloc")
            conn.send(("memory", too_costly) if out_of_memory else ("error", str(exc)))
        except MemoryError:
            conn.send(("memory", too_costly))


def _limit_address_space(extra_bytes: int) -> None:
    """RLIMIT_AS = the address space mapped now + `extra_bytes` (the imports and the vocabulary
    are not the compile's: a fixed limit would depend on the tokenizer)."""
    with open(f"/proc/{os.getpid()}/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
