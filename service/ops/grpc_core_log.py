"""What gRPC's C core writes on stderr during one call, caught so that it becomes a field.

The C core logs straight to file descriptor 2 in plain text (`E1201 ... add_port.cc:83] Failed
to add port ...`), past Python's logging: around a call that may fail that way (binding the
port), the descriptor is pointed at a temporary file and the text given back, for the caller to
put in its own JSON line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def grpc_core_log() -> Iterator[list[str]]:
    """Runs the block with fd 2 redirected; the list it yields holds, once the block has
    ended, the lines written there meanwhile (none, usually).

    NOTE: fd 2 is the process's: whatever any thread writes to stderr inside the block is caught
    too. Use it only around a short synchronous call, before other threads are logging (the
    bind, before the engine starts)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines += caught.read().decode(errors="replace").splitlines()
