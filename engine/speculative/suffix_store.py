"""The bounded store of recently finished outputs that `suffix` decoding proposes from, one
frequency table per LoRA adapter, oldest evicted first.

An entry is a finished request's output preceded by the last `ngram_max` tokens of its prompt,
so that the first tokens of an output are proposed from the prompt's end, as a new rollout of
the same prompt needs. Prompts are not stored whole: a request already proposes from its own
prompt, and a long prompt repeated by many rollouts would fill the store with copies of
itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.speculative.continuations import ContinuationCounts

# NOTE: the tables cost Python objects per stored token (at ngram 2..4, about 500 bytes a
# token where outputs do not repeat, 31 MiB at this default; 80 where rollouts repeat each
# other and share their contexts).
DEFAULT_STORE_TOKENS = 1 << 16


class SuffixStore:
    """At most `capacity` tokens of finished outputs (entries counted whole), each proposing
    only for requests of the adapter it was generated under (`adapter_key`; 0 is the base
    model). Adding an entry evicts the oldest entries, of any adapter, until the total fits; an
    entry longer than the capacity keeps its last `capacity` tokens. Capacity 0 stores nothing.
    """

    def __init__(self, ngram_min: int, ngram_max: int, capacity: int = DEFAULT_STORE_TOKENS):
        if capacity < 0:
            raise ValueError(f"suffix store capacity: must be >= 0, got {capacity}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.capacity = capacity
        self.entries: deque[tuple[int, list[int]]] = deque()  # (adapter_key, tokens), oldest first
        self.num_tokens = 0  # the entries' tokens, <= capacity
        self.tables: dict[int, ContinuationCounts] = {}  # per adapter_key holding entries
        self.entry_counts: dict[int, int] = {}  # per adapter_key: its entries

    def add(self, adapter_key: int, prompt_tail: Sequence[int], output: Sequence[int]) -> None:
        """Store an output (after the end of its prompt), evicting the oldest as needed."""
        if not output or self.capacity == 0:
            return
        tokens = [*prompt_tail, *output][-self.capacity :]
        self.entries.append((adapter_key, tokens))
        self.num_tokens += len(tokens)
        table = self.tables.get(adapter_key)
        if table is None:
            table = self.tables[adapter_key] = ContinuationCounts(self.ngram_min, self.ngram_max)
        table.add(tokens)
        self.entry_counts[adapter_key] = self.entry_counts.get(adapter_key, 0) + 1
        while self.num_tokens > self.capacity:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        adapter_key, tokens = self.entries.popleft()
        self.num_tokens -= len(tokens)
        self.tables[adapter_key].remove(tokens)
        self.entry_counts[adapter_key] -= 1
        if self.entry_counts[adapter_key] == 0:
            assert not self.tables[adapter_key], "removing every entry empties the table"
            del self.tables[adapter_key]
            del self.entry_counts[adapter_key]

    def table(self, adapter_key: int) -> ContinuationCounts | None:
        """The frequency table of `adapter_key`'s stored outputs; None if it has none."""
        return self.tables.get(adapter_key)

    def clear(self) -> None:
        self.entries.clear()
        self.num_tokens = 0
        self.tables.clear()
        self.entry_counts.clear()
