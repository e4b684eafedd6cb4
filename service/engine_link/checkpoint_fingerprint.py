"""checkpoint_fingerprint: what a checkpoint directory held, to tell later that it changed.

A restarted engine replays the last checkpoint update by reading its directory again; had the
directory been overwritten since, the replay would serve other weights under the same policy
version. The fingerprint covers what the engine reads: the index's content and every
safetensors file's name, size and modification time (stat calls and one small read, no tensor
data). A rewrite of a file changes its modification time even when its size stays.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

INDEX = "model.safetensors.index.json"


def checkpoint_fingerprint(directory: str) -> str | None:
    """A digest of `directory`'s checkpoint files as they are now; None if it cannot be read
    (the engine refuses such an update, so it is never replayed)."""
    digest = hashlib.sha256()
    try:
        root = Path(directory)
        index = root / INDEX
        if index.is_file():
            digest.update(index.read_bytes())
        for path in sorted(root.glob("*.safetensors")):
            stat = path.stat()
            digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    except OSError:
        return None
    return digest.hexdigest()
