"""The per-step attention inputs every backend reads: built once per step, read by every layer.

A model whose layers form several KV groups (engine/kv_cache/kv_groups.py: sliding windows)
has a block table and cache slots per group: the step's AttentionMetadata is group 0's and
carries the others in `groups`. Each layer's cache is then a `LayerCache`, which names its group,
and a backend attends through `meta.for_cache(cache)`: the metadata of that layer's group, so
a kernel reads only the table (and the window of the layer) it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeGroup:
    """Decode rows attended to in one call (torch_ref: their pages gathered to the longest)."""

    rows: torch.Tensor | None  # [rows] token index of each row; None: every token, in order
    tables: torch.Tensor  # [rows, pages]
    lens: torch.Tensor  # [rows] int32 context length of each row
    mask: torch.Tensor | None  # [rows, 1, 1, pages * page_size] True = attend (torch_ref's)


class LayerCache(tuple[torch.Tensor, torch.Tensor]):
    """One layer's K and V pages, in KV group `group` (a KVCache with its group)."""

    group: int

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, group: int) -> LayerCache:
        cache = super().__new__(cls, (k, v))
        cache.group = group
        return cache


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the packed batch and where its KV lives.

    The packed batch is a list of sequences, each feeding `query_lens[i]` new tokens; after the
    step sequence i has `context_lens[i]` tokens of KV (cached prefix + new tokens).

    Host lists describe the batch for eager steps. A captured decode step (CUDA graphs) reads
    only the tensors and the host ints, which are constants of the capture: `decode_only` is
    True, `max_query_len` is 1 and `max_context_len` is the block-table width in tokens, so
    shapes never depend on the batch's contents.
    """

    query_lens: list[int]  # new tokens per sequence, packed in this order
    context_lens: list[int]  # KV length per sequence after this step (prefix + new)
    slot_mapping: torch.Tensor | None  # [tokens] int64 cache slot (page * page_size + offset)
    block_tables: torch.Tensor | None  # [seqs, width] int32 page ids; entries past a
    # sequence's pages hold any valid page id and are never attended to
    seq_lens: torch.Tensor | None = None  # [seqs] int32: context_lens on the device
    query_start_loc: torch.Tensor | None = None  # [seqs + 1] int32: packed start of each seq
    max_query_len: int = 0
    max_context_len: int = 0  # an upper bound of context_lens (graph steps: the table width)
    decode_only: bool = False  # every sequence feeds exactly one token, with a KV cache
    # Derived by the torch_ref backend's prepare(); read by every layer.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_seqs: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (sequence index, first token index, query_len, context_len) of each prefill row
    # KV groups 1..: the same step through each group's slots and block table (sharing the
    # host lists and seq_lens); empty with one group.
    groups: list[AttentionMetadata] = field(default_factory=list)

    def for_cache(self, cache: tuple[torch.Tensor, torch.Tensor]) -> AttentionMetadata:
        """The metadata a layer with this cache attends through: its KV group's."""
        group = getattr(cache, "group", 0)
        return self.groups[group - 1] if group else self

    def with_tables(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        """This step through another KV group's cache slots and block table."""
        return AttentionMetadata(
            self.query_lens,
            self.context_lens,
            slot_mapping,
            block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.max_query_len,
            self.max_context_len,
            self.decode_only,
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def dense(cls, query_lens: list[int]) -> AttentionMetadata:
        """No KV cache: every sequence starts at position 0 and sees only its own tokens."""
        return cls(
            query_lens,
            list(query_lens),
            slot_mapping=None,
            block_tables=None,
            max_query_len=max(query_lens),
            max_context_len=max(query_lens),
        )
