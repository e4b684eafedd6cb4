"""`ngram`: prompt lookup. Propose what followed the request's latest tokens earlier in its own
prompt and output.

The rule is vLLM V1's (its `NgramProposer`): the longest n in [ngram_min, ngram_max] such that
the last n tokens of `token_ids` occurred earlier in them (an occurrence other than that suffix
itself, possibly overlapping it), then the up to `limit` tokens that followed the EARLIEST such
occurrence (its continuation runs at most to the end of `token_ids`, so it may be shorter than
`limit`). The earliest occurrence has the longest continuation available, which is why vLLM
picks it.

vLLM rescans the whole context each step (a KMP pass over the reversed tokens). Here each
request keeps a `LookupIndex` (the first position of every n-gram that has a continuation),
extended with the tokens appended since the previous call: a prompt of P tokens costs O(P)
once, then a step costs O(new tokens + ngram_max + limit), whatever the context's length.
The once is spread over steps: a call indexes at most `index_budget` tokens of a request (a
100,000-token prompt is a fraction of a second of Python, which would stall every request of
the step it landed in), and a request proposes nothing until its index has caught up.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.scheduling.request import Request

# Tokens of one request indexed per call, at most: a few milliseconds of host time.
DEFAULT_INDEX_BUDGET = 4096


class LookupIndex:
    """The first start position of each n-gram (ngram_min <= n <= ngram_max) of a token list
    that is followed by at least one token; one request's, grown as its tokens are appended.

    Contract: the list it is updated with only grows (a request's `token_ids` is append-only);
    a shorter list than the last one seen rebuilds the index from scratch. Memory: at most
    (ngram_max - ngram_min + 1) entries per token.
    """

    __slots__ = ("first", "length", "ngram_max", "ngram_min")

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.first: dict[tuple[int, ...], int] = {}
        self.length = 0  # how many tokens of the list have been indexed

    def update(self, tokens: Sequence[int], budget: int) -> bool:
        """Index up to `budget` of the tokens appended since the last update; whether the
        index now covers all of `tokens`."""
        if len(tokens) < self.length:
            self.first.clear()
            self.length = 0
        lo, hi = self.ngram_min, self.ngram_max
        first = self.first
        stop = min(len(tokens), max(self.length, 1) + budget)
        for p in range(max(self.length, 1), stop):
            # tokens[p] is new: the n-grams ending just before it now have a continuation.
            window = tuple(tokens[max(0, p - hi) : p])
            for n in range(lo, len(window) + 1):
                # setdefault: an n-gram seen before keeps its first (earliest) position.
                first.setdefault(window[-n:], p - n)
        self.length = max(self.length, stop)
        return self.length == len(tokens)

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens following the earliest earlier occurrence of the longest
        matching suffix of `tokens` (which must be what the index was last updated with)."""
        end = len(tokens)
        for n in range(min(self.ngram_max, end), self.ngram_min - 1, -1):
            start = self.first.get(tuple(tokens[end - n : end]))
            if start is not None:
                return list(tokens[start + n : min(start + n + limit, end)])
        return []

    def __len__(self) -> int:
        return len(self.first)


class NgramProposer:
    """Prompt lookup over each request's prompt and output (see the module's docstring)."""

    method = "ngram"

    def __init__(
        self, ngram_min: int, ngram_max: int, index_budget: int = DEFAULT_INDEX_BUDGET
    ) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(
                f"ngram: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}"
            )
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.index_budget = index_budget
        self.indexes: dict[tuple[str, int], LookupIndex] = {}

    def propose(self, reqs: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        proposals = []
        for req, limit in zip(reqs, limits, strict=True):
            index = self.indexes.get(req.key)
            if index is None:
                index = self.indexes[req.key] = LookupIndex(self.ngram_min, self.ngram_max)
            if index.update(req.token_ids, self.index_budget):
                proposals.append(index.propose(req.token_ids, limit))
            else:
                proposals.append([])  # still catching up with a long prompt
        return proposals

    def finished(self, req: Request) -> None:
        self.indexes.pop(req.key, None)

    def weights_updated(self) -> None:
        """Nothing to drop: proposals are a function of the request's tokens alone."""
