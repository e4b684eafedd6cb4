"""Copy units: training text whose continuation repeats what came before, so a model learns to copy.

The demo model, trained on the corpus alone, does not copy in context (it lacks the induction
heads that real LLMs learn from web-scale text), so prompt lookup (speculative decoding's `ngram`
and `suffix` methods) finds nothing to propose on a prompt whose answer repeats the prompt. The
demo's copy model (`ensure_demo_checkpoint(size="copy")`, bench/speculative.py's copy task)
trains on the same corpus plus these units: a span of words, a newline, the same span, a few
times over, as `<s> span\\nspan\\n...span </s>`, the way the bench's copy prompts read (a
passage, a newline, its first words).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyUnits:
    """How much of the training stream is copy units, and their shape (with the seed, part of
    the copy model's recipe and so of its cache key)."""

    share: float  # of the whole stream's tokens, the plain corpus being the rest
    min_words: int = 8
    max_words: int = 40
    min_repeats: int = 2  # copies of the span in a unit (the first included)
    max_repeats: int = 4
    # Of the units, those whose span is random corpus words rather than running text: they can
    # be predicted by copying alone, not by remembering the corpus, and teach copying faster.
    scrambled: float = 0.0
    # Of a running-text span's words, the share replaced by random distinct words: where the
    # corpus is memorised, its own text can be continued from memory, not copied; a replaced
    # word can only be copied, in text that otherwise reads as the corpus (as a prompt does).
    replaced: float = 0.0
    # The corpus's copies in the stream (1: once). A fixed pool of units is memorised like the
    # corpus after a few dozen passes, and a model that remembers a unit need not copy it: with
    # the corpus tiled, `share` still sets how often a window is a unit, but the units are that
    # many times as many, each seen that many times less often.
    corpus_copies: int = 1

    def __post_init__(self) -> None:
        assert 0.0 < self.share < 1.0, "share: the plain corpus must remain"
        assert 1 <= self.min_words <= self.max_words
        assert 2 <= self.min_repeats <= self.max_repeats
        assert 0.0 <= self.scrambled <= 1.0
        assert 0.0 <= self.replaced <= 1.0
        assert self.corpus_copies >= 1


def copy_units(
    units: CopyUnits,
    paragraphs: list[str],
    encode: Callable[[str], list[int]],
    eos: int,
    plain_tokens: int,
    seed: int,
) -> list[int]:
    """Token ids of copy units, `<s>` (from `encode`) to `eos` each, end to end: as many as make
    them `units.share` of a stream with `plain_tokens` corpus tokens. Spans are whole words
    within a paragraph, `units.replaced` of them replaced by words drawn from all paragraphs
    (or, for a scrambled unit, all words drawn from all of them). Deterministic
    given the seed."""
    rng = random.Random(seed)
    texts = [p.split() for p in paragraphs]
    # Each distinct word alike: frequency-weighted draws repeat "the" and "and" so often that
    # a word seldom says where in the span it stands.
    words = sorted({w for text in texts for w in text})
    long_enough = [text for text in texts if len(text) >= units.min_words]
    assert long_enough, "no paragraph has min_words words"
    wanted = int(plain_tokens * units.share / (1.0 - units.share))
    ids: list[int] = []
    while len(ids) < wanted:
        text = rng.choice(long_enough)
        count = rng.randint(units.min_words, min(units.max_words, len(text)))
        if rng.random() < units.scrambled:
            span = [rng.choice(words) for _ in range(count)]
        else:
            start = rng.randint(0, len(text) - count)
            span = text[start : start + count]
            if units.replaced > 0.0:
                span = [rng.choice(words) if rng.random() < units.replaced else w for w in span]
        repeats = rng.randint(units.min_repeats, units.max_repeats)
        ids += encode("\n".join([" ".join(span)] * repeats)) + [eos]
    return ids
