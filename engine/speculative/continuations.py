"""How often each token followed each short context in some token sequences: the frequency
table `suffix` decoding proposes from (a depth-bounded stand-in for SuffixDecoding's suffix
tree, whose node counts are these numbers for contexts up to its depth).

A context is an n-gram with ngram_min <= n <= ngram_max; its continuations are a small dict
{token: count}. A sequence can be added whole, extended as it grows, or removed again (the
exact inverse of adding it), so a bounded store can evict its oldest sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

# NOTE: bounds the work of choosing a context's most frequent continuation (a max over its
# dict, every proposed token) and its memory, whatever the text: after "a b" in a prompt that
# lists "a b 1, a b 2, ..." thousands of tokens followed the context. A context tracks its
# first MAX_BRANCHES distinct continuations; a further one is not counted until a tracked
# one's count falls to zero (by removal). The counts then undercount, never overcount: a
# count never exceeds the occurrences in the sequences present (so removing every sequence
# empties the table).
MAX_BRANCHES = 8


class ContinuationCounts:
    """{context: {next token: count}} over the sequences added and not removed."""

    __slots__ = ("max_branches", "ngram_max", "ngram_min", "table")

    def __init__(self, ngram_min: int, ngram_max: int, max_branches: int = MAX_BRANCHES) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_branches = max_branches
        self.table: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: Sequence[int], start: int = 1, stop: int | None = None) -> None:
        """Count the continuation tokens[p] of each context ending at p - 1, for p from
        `start` (extending a sequence counted up to `start`) to `stop` (default: its end)."""
        lo, hi, cap = self.ngram_min, self.ngram_max, self.max_branches
        table = self.table
        for p in range(max(start, 1), len(tokens) if stop is None else stop):
            window = tuple(tokens[max(0, p - hi) : p])
            token = tokens[p]
            for n in range(lo, len(window) + 1):
                counts = table.get(window[-n:])
                if counts is None:
                    table[window[-n:]] = {token: 1}
                elif token in counts:
                    counts[token] += 1
                elif len(counts) < cap:
                    counts[token] = 1

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)` (the whole sequence, as it was added)."""
        lo, hi = self.ngram_min, self.ngram_max
        table = self.table
        for p in range(1, len(tokens)):
            window = tuple(tokens[max(0, p - hi) : p])
            token = tokens[p]
            for n in range(lo, len(window) + 1):
                context = window[-n:]
                counts = table.get(context)
                if counts is None or token not in counts:
                    continue  # not counted when added: its context's branches were full
                if counts[token] > 1:
                    counts[token] -= 1
                elif len(counts) > 1:
                    del counts[token]
                else:
                    del table[context]

    def get(self, context: tuple[int, ...]) -> dict[int, int] | None:
        """The continuations counted after `context`; None if none."""
        return self.table.get(context)

    def __len__(self) -> int:
        """The number of contexts held (the table's memory is proportional to it)."""
        return len(self.table)
