"""How often each token followed each short context in some token sequences: the frequency
table `suffix` decoding proposes from (a depth-bounded stand-in for SuffixDecoding's suffix
tree, whose node counts are these numbers for contexts up to its depth).

A context is an n-gram with ngram_min <= n <= ngram_max. A sequence can be added whole,
extended as it grows, or removed again (the exact inverse of adding it), so a bounded store
can evict its oldest sequences. Token ids are in [0, 2**32).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

# NOTE: bounds the work of choosing a context's most frequent continuation (a max over its
# continuations, every proposed token) and its memory, whatever the text: after "a b" in a
# prompt that lists "a b 1, a b 2, ..." thousands of tokens followed the context. A context
# tracks its first MAX_BRANCHES distinct continuations; a further one is not counted until a
# tracked one's count falls to zero (by removal). The counts then undercount, never
# overcount: a count never exceeds the occurrences in the sequences present (so removing every
# sequence empties the table).
MAX_BRANCHES = 8

# A context followed by one token only (most of them, in text) holds it packed in one int,
# count * ONE + token, instead of a dict {token: count}: 32 bytes against 224, which makes the
# whole table about 2.5 times smaller.
TOKEN_BITS = 32
ONE = 1 << TOKEN_BITS
TOKEN_MASK = ONE - 1

Continuations = int | dict[int, int]  # packed (one token) or {token: count} (several)


class ContinuationCounts:
    """{context: continuations} over the sequences added and not removed; `get` reads a
    context's as {next token: count}."""

    __slots__ = ("max_branches", "ngram_max", "ngram_min", "table")

    def __init__(self, ngram_min: int, ngram_max: int, max_branches: int = MAX_BRANCHES) -> None:
        assert max_branches >= 2, "a context with two continuations holds them in a dict"
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_branches = max_branches
        self.table: dict[tuple[int, ...], Continuations] = {}

    def add(self, tokens: Sequence[int], start: int = 1, stop: int | None = None) -> None:
        """Count the continuation tokens[p] of each context ending at p - 1, for p from
        `start` (extending a sequence counted up to `start`) to `stop` (default: its end)."""
        table, cap = self.table, self.max_branches
        for context, token in self._pairs(tokens, max(start, 1), stop):
            entry = table.get(context)
            if entry is None:
                table[context] = ONE + token
            elif isinstance(entry, int):
                if entry & TOKEN_MASK == token:
                    table[context] = entry + ONE
                else:
                    table[context] = {entry & TOKEN_MASK: entry >> TOKEN_BITS, token: 1}
            elif token in entry:
                entry[token] += 1
            elif len(entry) < cap:
                entry[token] = 1

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)` (the whole sequence, as it was added)."""
        table = self.table
        for context, token in self._pairs(tokens, 1, None):
            entry = table.get(context)
            if entry is None:
                continue
            if isinstance(entry, int):
                if entry & TOKEN_MASK != token:
                    continue  # not counted when added: its context's branches were full
                if entry >= 2 * ONE:
                    table[context] = entry - ONE
                else:
                    del table[context]
            elif token not in entry:
                continue  # as above
            elif entry[token] > 1:
                entry[token] -= 1
            else:
                del entry[token]
                if len(entry) == 1:
                    ((last, count),) = entry.items()
                    table[context] = count * ONE + last

    def _pairs(
        self, tokens: Sequence[int], start: int, stop: int | None
    ) -> Iterator[tuple[tuple[int, ...], int]]:
        """(context, the token after it) for each position p in [start, stop) and each
        context length in [ngram_min, ngram_max] that fits before p."""
        lo, hi = self.ngram_min, self.ngram_max
        for p in range(start, len(tokens) if stop is None else stop):
            window = tuple(tokens[max(0, p - hi) : p])
            token = tokens[p]
            for n in range(lo, len(window) + 1):
                yield window[-n:], token

    def get(self, context: tuple[int, ...]) -> dict[int, int] | None:
        """The continuations counted after `context`, {token: count}; None if none."""
        entry = self.table.get(context)
        if isinstance(entry, int):
            return {entry & TOKEN_MASK: entry >> TOKEN_BITS}
        return entry

    def __len__(self) -> int:
        """The number of contexts held (the table's memory is proportional to it)."""
        return len(self.table)
