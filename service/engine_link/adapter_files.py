"""AdapterFiles: the service's file work for LoRA adapters, on its own small thread pool.

Reading an adapter's `adapter_config.json` (to check it before the engine sees it, and to
fingerprint the directory for the replay) and writing a streamed adapter's spool touch paths
and bytes a caller chose. They run here, never on the default executor that tokenizes prompts
and renders chat templates: a slow disk or a hostile path delays adapter calls only. The
reads themselves cannot hang or grow without bound (engine/protocol/validation/adapter_config.py: regular
files only, opened without blocking, at most MAX_CONFIG_BYTES).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.protocol.validation.adapter_config import check_config, parse_config, read_config_bytes
from service.engine_link.checkpoint_fingerprint import checkpoint_fingerprint

T = TypeVar("T")
WORKERS = 2  # a config check may run beside a spool's writes


class AdapterFiles:
    def __init__(self, max_rank: int) -> None:
        self.max_rank = max_rank  # the engine's max_lora_rank: a larger `r` is refused here
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="sluice-adapter-files")

    async def run(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` on this pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    async def check(self, path: str) -> str | None:
        """Check the adapter directory `path`'s config (ValueError naming the field or the
        file); its fingerprint, None when it cannot be read (the engine then says why)."""
        return await self.run(self._check, path)

    async def fingerprint(self, path: str) -> str | None:
        """What the directory `path` holds now; None if it cannot be read or checked."""
        try:
            return await self.check(path)
        except ValueError:
            return None

    def _check(self, path: str) -> str | None:
        try:
            config = read_config_bytes(path)
        except OSError:
            return None
        check_config(parse_config(config), self.max_rank)
        weights = checkpoint_fingerprint(path)
        return None if weights is None else hashlib.sha256(config + weights.encode()).hexdigest()

    def close(self) -> None:
        """No new work; what runs finishes in its thread (the server is stopping)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
