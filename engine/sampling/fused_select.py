"""Radix select on the order keys: top-k's and top-p's thresholds without a sort.

A key (int32) is read as u = key + 2^31, an unsigned 32-bit value in the same order, four
8-bit digits from the top. Level L's histogram (256 bins) counts the keys whose digits above
L equal the prefix chosen so far, by their digit L; the vocabulary passes build the histograms
(engine/sampling/fused_passes.py), every program of a row adding its slice's with integer
atomics, so the sum is the same in any order. These functions walk the histograms of the
levels already built, the same walk in every program of a row, to the prefix they determine:
- top-k: the k-th largest key (Sampler._threshold's sorted_keys[k - 1]): at each level the
  bin where the count from the top reaches the k still needed;
- top-p: the least key v among top-k's survivors with mass(survivors > v) <= top_p times their
  mass (a group of equal keys is kept or dropped together, as the sort and cumulative sum
  decide it): at each level the least non-empty bin whose mass above, plus the mass above the
  prefix, is at most the limit; the masses are int64 sums, compared in float64 as there.

A row's scratch (int64, zero between calls) holds the histograms and two atomic maxima.
"""

# ruff: noqa: SIM102  (a constexpr `if` and a runtime `if` do not merge into one in Triton)
from __future__ import annotations

import triton
import triton.language as tl

BINS = 256
LEVELS = 4
COUNTS = 0  # top-k counts, [LEVELS, BINS]
PRESENT = COUNTS + LEVELS * BINS  # top-p counts of survivors (which bins are non-empty)
MASSES = PRESENT + LEVELS * BINS  # top-p masses of survivors
GREEDY = MASSES + LEVELS * BINS  # max pack of (processed key, token): the argmax and the max
RACE = GREEDY + 1  # max pack of (race score key, token): the sampled token
GATHERED = RACE + 1  # survivors gathered so far (engine/sampling/fused_survivors.py)
SCRATCH = GATHERED + 1

_BINS = tl.constexpr(BINS)
_HALF = tl.constexpr(1 << 31)


@triton.jit
def unsigned_keys(keys):
    """int32 order keys -> int64 values in [0, 2^32), in the same order."""
    return keys.to(tl.int64) + _HALF


@triton.jit
def digit(u, LEVEL: tl.constexpr):
    return ((u >> (24 - 8 * LEVEL)) & 255).to(tl.int32)


@triton.jit
def histogram(digits, chosen):
    """Counts of the chosen digits per bin (no `mask` argument: older Tritons lack it)."""
    counts = tl.histogram(tl.where(chosen, digits, 0), _BINS)
    dropped = tl.sum((chosen == 0).to(tl.int32), axis=0)
    return counts - tl.where(tl.arange(0, _BINS) == 0, dropped, 0)


@triton.jit
def in_prefix(u, prefix, LEVEL: tl.constexpr):
    """Whether u's digits above LEVEL are `prefix` (always at level 0)."""
    return (u >> (32 - 8 * LEVEL)) == prefix


@triton.jit
def kth_prefix(counts_row, k, LEVELS_DONE: tl.constexpr):
    """The first LEVELS_DONE digits of the k-th largest u, from the count histograms."""
    return _kth_walk(counts_row, k, LEVELS_DONE)[0]


@triton.jit
def top_k_survivors(counts_row, k):
    """(the k-th largest u, how many keys are at least it: k and the k-th's ties)."""
    return _kth_walk(counts_row, k, LEVELS)


@triton.jit
def _kth_walk(counts_row, k, LEVELS_DONE: tl.constexpr):
    bins = tl.arange(0, _BINS).to(tl.int64)
    prefix = tl.full((), 0, tl.int64)
    need = k.to(tl.int64)
    kept = need
    for level in tl.static_range(LEVELS_DONE):
        h = tl.load(counts_row + level * _BINS + bins)
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        b = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
        kept = k - need + tl.sum(tl.where(bins == b, at_or_above, 0), axis=0)
        need -= tl.sum(tl.where(bins == b, at_or_above - h, 0), axis=0)
        prefix = prefix * _BINS + b
    return prefix, kept


@triton.jit
def top_p_limit(scratch_row, top_p):
    """top_p times the survivors' mass (every survivor is in level 0's histogram)."""
    total = tl.sum(tl.load(scratch_row + MASSES + tl.arange(0, _BINS)), axis=0)
    return top_p.to(tl.float64) * total.to(tl.float64)


@triton.jit
def top_p_prefix(scratch_row, limit, LEVELS_DONE: tl.constexpr):
    """The first LEVELS_DONE digits of top-p's threshold u, from the mass histograms."""
    bins = tl.arange(0, _BINS).to(tl.int64)
    prefix = tl.full((), 0, tl.int64)
    above = tl.full((), 0, tl.int64)  # the survivors' mass above the prefix's range
    for level in tl.static_range(LEVELS_DONE):
        mass = tl.load(scratch_row + MASSES + level * _BINS + bins)
        present = tl.load(scratch_row + PRESENT + level * _BINS + bins)
        above_bin = above + tl.sum(mass, axis=0) - tl.cumsum(mass, axis=0)
        ok = (present > 0) & (above_bin.to(tl.float64) <= limit)
        b = tl.min(tl.where(ok, bins, _BINS), axis=0)
        above = tl.sum(tl.where(bins == b, above_bin, 0), axis=0)
        prefix = prefix * _BINS + b
    return prefix


@triton.jit
def kept_floor(scratch_row, top_k, top_p, vocab, TOP_K: tl.constexpr, TOP_P: tl.constexpr):
    """The least u the row keeps: top-p's threshold, else top-k's, else 0 (every token)."""
    floor = tl.full((), 0, tl.int64)
    if TOP_K:
        if (top_k > 0) & (top_k < vocab):
            floor = kth_prefix(scratch_row + COUNTS, top_k, LEVELS)
    if TOP_P:
        if top_p < 1.0:
            floor = top_p_prefix(scratch_row, top_p_limit(scratch_row, top_p), LEVELS)
    return floor
