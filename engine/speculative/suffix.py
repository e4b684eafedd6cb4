"""`suffix`: suffix decoding (Arctic Inference's SuffixDecoding): propose from the request's
own tokens and from the outputs of recently finished requests, so that repeated rollouts (and
agents that repeat themselves) propose each other's text.

Sources, both frequency tables (engine/speculative/continuations.py) over contexts of
ngram_min to ngram_max tokens:
- the request's own prompt and output, its table grown with the tokens appended since the
  previous call (O(new tokens) a step; dropped when the request finishes; at most
  `index_budget` tokens a call, as ngram's index, the store alone proposing until it has
  caught up with a long prompt);
- the store of finished outputs of the request's adapter (engine/speculative/suffix_store.py:
  bounded in tokens, oldest evicted first; a finished request's output joins it).

Rule, token by token up to the limit: take the longest context (the last n tokens of the
request followed by what is proposed so far, n from ngram_max down to ngram_min) that either
source has seen followed by something; add the two sources' counts of its continuations;
propose the most frequent (ties: the smallest token id), and stop at the first token whose
estimated probability, the product over the proposal of count / total of its context, falls
below `min_probability` (SuffixDecoding's `min_token_prob`, same default), or where no context
matches. A step costs O(limit x (ngram_max - ngram_min + 1) x MAX_BRANCHES) dict work,
whatever the lengths of the context and the store.

Where SuffixDecoding differs: its suffix trees match contexts up to their depth (24 in vLLM)
and each tree's speculation is scored separately, the better one kept; this one bounds the
match at ngram_max, a table per context being Python objects, and merges the two sources.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.scheduling.request import Request
from engine.speculative.continuations import ContinuationCounts
from engine.speculative.ngram import DEFAULT_INDEX_BUDGET
from engine.speculative.suffix_store import DEFAULT_STORE_TOKENS, SuffixStore

DEFAULT_MIN_PROBABILITY = 0.1


class RequestCounts:
    """One request's own frequency table, grown as its `token_ids` (append-only) grow; a
    shorter list than the last one seen rebuilds it."""

    __slots__ = ("counts", "length")

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.counts = ContinuationCounts(ngram_min, ngram_max)
        self.length = 0  # how many tokens have been counted

    def update(self, tokens: Sequence[int], budget: int) -> bool:
        """Count up to `budget` of the tokens appended since the last update; whether the
        table now covers all of `tokens`."""
        if len(tokens) < self.length:
            self.counts.table.clear()
            self.length = 0
        stop = min(len(tokens), max(self.length, 1) + budget)
        self.counts.add(tokens, start=self.length, stop=stop)
        self.length = max(self.length, stop)
        return self.length == len(tokens)


class SuffixProposer:
    """Suffix decoding over each request's tokens and a store of finished outputs (see the
    module's docstring). `store_tokens` bounds the store (0: only the request's own tokens)."""

    method = "suffix"

    def __init__(
        self,
        ngram_min: int,
        ngram_max: int,
        store_tokens: int = DEFAULT_STORE_TOKENS,
        min_probability: float = DEFAULT_MIN_PROBABILITY,
        index_budget: int = DEFAULT_INDEX_BUDGET,
    ) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(
                f"suffix: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}"
            )
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.min_probability = min_probability
        self.index_budget = index_budget
        self.own: dict[tuple[str, int], RequestCounts] = {}
        self.store = SuffixStore(ngram_min, ngram_max, store_tokens)

    def propose(self, reqs: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        proposals = []
        for req, limit in zip(reqs, limits, strict=True):
            own = self.own.get(req.key)
            if own is None:
                own = self.own[req.key] = RequestCounts(self.ngram_min, self.ngram_max)
            caught_up = own.update(req.token_ids, self.index_budget)
            # NOTE: a partial own table would count a prefix of the prompt only: the store
            # alone proposes until the table has caught up.
            mine = own.counts if caught_up else None
            stored = self.store.table(req.adapter_key)
            proposals.append(self._continue(req.token_ids, limit, mine, stored))
        return proposals

    def _continue(
        self,
        tokens: Sequence[int],
        limit: int,
        own: ContinuationCounts | None,
        stored: ContinuationCounts | None,
    ) -> list[int]:
        context = list(tokens[max(0, len(tokens) - self.ngram_max) :])
        proposal: list[int] = []
        probability = 1.0
        while len(proposal) < limit:
            counts = self._longest_match(context, own, stored)
            if counts is None:
                break
            token = min(counts, key=lambda t: (-counts[t], t))
            probability *= counts[token] / sum(counts.values())
            if probability < self.min_probability:
                break
            proposal.append(token)
            context.append(token)
            if len(context) > self.ngram_max:
                del context[0]
        return proposal

    def _longest_match(
        self,
        context: list[int],
        own: ContinuationCounts | None,
        stored: ContinuationCounts | None,
    ) -> dict[int, int] | None:
        """The continuations (both sources' counts added) of the longest suffix of `context`
        that has any; None if no suffix of at least ngram_min tokens has."""
        for n in range(min(self.ngram_max, len(context)), self.ngram_min - 1, -1):
            key = tuple(context[len(context) - n :])
            mine = own.get(key) if own is not None else None
            theirs = stored.get(key) if stored is not None else None
            if mine is None:
                if theirs is not None:
                    return theirs
            elif theirs is None:
                return mine
            else:
                merged = dict(mine)
                for token, count in theirs.items():
                    merged[token] = merged.get(token, 0) + count
                return merged
        return None

    def finished(self, req: Request) -> None:
        """Forget the request's own table; store its output, after its prompt's last
        ngram_max tokens (the contexts its first output tokens followed)."""
        self.own.pop(req.key, None)
        tail = req.token_ids[max(0, req.prompt_len - self.ngram_max) : req.prompt_len]
        self.store.add(req.adapter_key, tail, req.output_token_ids)

    def weights_updated(self) -> None:
        """Nothing to drop: proposals are a function of tokens, not of weights. Outputs
        sampled under the old weights stay in the store: the next rollouts, under weights a
        step away, still repeat much of them, and a proposal that no longer holds is only
        rejected."""
