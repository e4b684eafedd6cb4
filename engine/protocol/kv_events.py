"""What the prefix cache reports of itself, and the message that flushes it.

The engine's prefix cache (engine/kv_cache/prefix_cache.py) records an event as its index
changes: full pages published (BlockStored), hashed pages forgotten to make room
(BlockRemoved), everything forgotten at once (AllBlocksCleared: a weight update, a sleep, a
FlushCache, a new engine). The events leave the engine with the StepOutput or Heartbeat that
follows them, in the order they happened; the service numbers them (service/engine_link/
kv_event_log.py) and the vLLM worker protocol streams them to the gateway.

A page's hash is the cache's own chain hash (parent hash, page tokens, folded over the policy
version and LoRA adapter): a Python int hash of ints and tuples of ints, so it fits an int64
and is the same in every process whatever PYTHONHASHSEED says.

Standard library only, like every module of engine/protocol.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Pages published in one chain: page i's parent is page i-1, the first page's parent is
    `parent_hash` (None: the first page of a sequence). `token_ids[i]` are page i's tokens
    (a page size of them); `adapter` the LoRA adapter key the hashes fold (0: base model)."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[tuple[int, ...]]
    adapter: int = 0


@dataclass(frozen=True)
class BlockRemoved:
    """Pages the cache forgot (evicted to make room): their hashes."""

    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The cache forgot every page: nothing published before this event can be hit."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class FlushCache:
    """Service -> engine: forget every prefix-cache entry now (requests keep running and keep
    their pages, unshared). Answered by CacheFlushed; the cache records AllBlocksCleared."""

    flush_id: str


@dataclass(frozen=True)
class CacheFlushed:
    """The answer to a FlushCache: `pages_freed` unreferenced cached pages went back to the
    free list. `error` is set only when the engine was lost before it answered."""

    flush_id: str
    pages_freed: int = 0
    error: str = ""
