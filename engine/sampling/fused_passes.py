"""The fused sampler's passes over the vocabulary: one kernel each, program (row, split) on
tokens [split * slice_len, (split + 1) * slice_len) of its row.

- `stats_pass`: marks the slice's penalised and banned ids, then in one pass: the greedy pack
  (an atomic max: argmax and max at once), the slice's log-sum-exps (partials, merged by
  engine/sampling/fused_finish.py), its top-logprob candidates, and top-k's level-0 histogram;
- `count_pass`: top-k's histogram at level 1, 2 or 3 (engine/sampling/fused_select.py);
- `mass_pass`: top-p's histograms (survivors present, their masses) at one level, among
  top-k's survivors when top-k is set;
- `race_pass`: the exponential race over the kept tokens, the slice's winner an atomic max.
A row's programs meet only through integer atomics and the next launch, so the result does
not depend on their order. Rows that an option does not concern skip its pass.
"""

# ruff: noqa: SIM102  (a constexpr `if` and a runtime `if` do not merge into one in Triton)
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling import sampling_math as sm
from engine.sampling.fused_blocks import (
    BANNED,
    SEEN,
    block_best,
    key_value,
    load_block,
    pack,
    pack_key,
    program_slice,
    row_floats,
    scatter_ids,
)
from engine.sampling.fused_math import exp_weights, order_keys
from engine.sampling.fused_select import (
    BINS,
    COUNTS,
    GREEDY,
    MASSES,
    PRESENT,
    RACE,
    SCRATCH,
    digit,
    histogram,
    in_prefix,
    kept_floor,
    kth_prefix,
    top_p_limit,
    top_p_prefix,
    unsigned_keys,
)
from engine.sampling.fused_survivors import race_scores, row_noise_key, top_k_floor

_MASS = tl.constexpr(sm.MASS_SCALE)
_BINS = tl.constexpr(BINS)
_SCRATCH = tl.constexpr(SCRATCH)
_MIN64 = tl.constexpr(-(1 << 63))
_MAX64 = tl.constexpr((1 << 63) - 1)


@triton.jit
def stats_pass(
    logits_ptr, logits_stride, floats_ptr, ints_ptr,
    ctx_ptr, ctx_stride, ctx_width, ban_ptr, ban_stride, ban_width,
    marks_ptr, raw_rows_ptr, scratch_ptr, parts_ptr, tops_ptr, vocab, slice_len,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, TOP_K: tl.constexpr,
    LOGPROBS: tl.constexpr, RAW: tl.constexpr, NUM_TOP: tl.constexpr, TOPB: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row, lo, hi = program_slice(vocab, slice_len)
    logits_row = logits_ptr + row * logits_stride
    marks_row = marks_ptr + row * vocab
    scratch_row = scratch_ptr + row * _SCRATCH
    temp, _, _, rep, freq, pres = row_floats(floats_ptr, row)
    divisor = tl.where(temp > 0, temp, 1.0)
    top_k = tl.load(ints_ptr + row * 5 + 3)
    if PENALTIES:
        start_pos = tl.load(ints_ptr + row * 5 + 4)
        ctx_row = ctx_ptr + row * ctx_stride
        scatter_ids(ctx_row, ctx_width, marks_row, lo, hi, start_pos, SEEN, True, BLOCK)
    if BANS:
        ban_row = ban_ptr + row * ban_stride
        scatter_ids(ban_row, ban_width, marks_row, lo, hi, 0, BANNED, False, BLOCK)
    if PENALTIES or BANS:
        tl.debug_barrier()  # every mark of the slice is set before the pass reads one
    is_raw = False
    if RAW:
        is_raw = True
        if LOGPROBS:
            is_raw = tl.load(raw_rows_ptr + row) != 0
    count_k = (temp > 0) & (top_k > 0) & (top_k < vocab)

    best = tl.full((), 0, tl.int64)
    m = -3.4e38
    total = 0.0
    raw_m = -3.4e38
    raw_total = 0.0
    hist = tl.zeros([_BINS], dtype=tl.int32)
    slots = tl.arange(0, TOPB)
    top = tl.where(slots < NUM_TOP, _MIN64, _MAX64)  # slots past NUM_TOP are never replaced
    for start in range(lo, hi, BLOCK):
        ids, mask, raw, x = load_block(
            logits_row, marks_row, start, hi, rep, freq, pres, divisor, PENALTIES, BANS, BLOCK
        )
        best = tl.maximum(best, block_best(x, ids))
        if LOGPROBS:
            new_m = tl.maximum(m, tl.max(x, axis=0))
            total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        if RAW:
            new_raw_m = tl.maximum(raw_m, tl.max(raw, axis=0))
            raw_total = raw_total * tl.exp(raw_m - new_raw_m) + tl.sum(
                tl.exp(raw - new_raw_m), axis=0
            )
            raw_m = new_raw_m
        if TOP_K:
            if count_k:
                u = unsigned_keys(order_keys(x))
                hist += histogram(digit(u, 0), mask)
        if NUM_TOP > 0:
            source = x
            if RAW:
                source = tl.where(is_raw, raw, x)
            ranked = tl.where(mask, pack(order_keys(source), ids), _MIN64)
            top = _merge_top(top, ranked, NUM_TOP, TOPB)

    tl.atomic_max(scratch_row + GREEDY, best)
    if TOP_K:
        if count_k:
            bins = tl.arange(0, _BINS)
            tl.atomic_add(scratch_row + COUNTS + bins, hist.to(tl.int64), mask=hist > 0)
    part = row * tl.num_programs(1) + tl.program_id(1)
    if LOGPROBS or RAW:
        tl.store(parts_ptr + part * 4, m)
        tl.store(parts_ptr + part * 4 + 1, total)
        tl.store(parts_ptr + part * 4 + 2, raw_m)
        tl.store(parts_ptr + part * 4 + 3, raw_total)
    if NUM_TOP > 0:
        tl.store(tops_ptr + part * TOPB + slots, tl.where(slots < NUM_TOP, top, _MIN64))


@triton.jit
def _merge_top(top, ranked, NUM_TOP: tl.constexpr, TOPB: tl.constexpr):
    """The NUM_TOP largest of top's and ranked's (distinct) values, unordered, in top's slots."""
    if tl.max(ranked, axis=0) > tl.min(top, axis=0):  # most blocks hold no candidate
        slots = tl.arange(0, TOPB)
        for _ in tl.static_range(NUM_TOP):
            b = tl.max(ranked, axis=0)
            slot = tl.argmin(top, axis=0)
            top = tl.where((slots == slot) & (b > tl.min(top, axis=0)), b, top)
            ranked = tl.where(ranked == b, _MIN64, ranked)
    return top


@triton.jit
def count_pass(
    logits_ptr, logits_stride, floats_ptr, ints_ptr, marks_ptr, scratch_ptr, vocab, slice_len,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, LEVEL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, lo, hi = program_slice(vocab, slice_len)
    temp, _, _, rep, freq, pres = row_floats(floats_ptr, row)
    top_k = tl.load(ints_ptr + row * 5 + 3)
    if (temp > 0) & (top_k > 0) & (top_k < vocab):
        logits_row = logits_ptr + row * logits_stride
        marks_row = marks_ptr + row * vocab
        counts_row = scratch_ptr + row * _SCRATCH + COUNTS
        prefix = kth_prefix(counts_row, top_k, LEVEL)
        hist = tl.zeros([_BINS], dtype=tl.int32)
        for start in range(lo, hi, BLOCK):
            _, mask, _, x = load_block(
                logits_row, marks_row, start, hi, rep, freq, pres, temp, PENALTIES, BANS, BLOCK
            )
            u = unsigned_keys(order_keys(x))
            hist += histogram(digit(u, LEVEL), mask & in_prefix(u, prefix, LEVEL))
        bins = tl.arange(0, _BINS)
        level_row = counts_row + LEVEL * _BINS
        tl.atomic_add(level_row + bins, hist.to(tl.int64), mask=hist > 0)


@triton.jit
def mass_pass(
    logits_ptr, logits_stride, floats_ptr, ints_ptr, marks_ptr, scratch_ptr, vocab, slice_len,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, TOP_K: tl.constexpr, LEVEL: tl.constexpr,
    SURVIVORS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, lo, hi = program_slice(vocab, slice_len)
    temp, top_p, _, rep, freq, pres = row_floats(floats_ptr, row)
    scratch_row = scratch_ptr + row * _SCRATCH
    floor = tl.full((), 0, tl.int64)
    gathered = tl.full((), 0, tl.int32)
    if TOP_K:
        top_k = tl.load(ints_ptr + row * 5 + 3)
        floor, gathered = top_k_floor(scratch_row, temp, top_k, vocab, SURVIVORS)
    if (temp > 0) & (top_p < 1.0) & (gathered == 0):
        logits_row = logits_ptr + row * logits_stride
        marks_row = marks_ptr + row * vocab
        prefix = tl.full((), 0, tl.int64)
        if LEVEL > 0:
            prefix = top_p_prefix(scratch_row, top_p_limit(scratch_row, top_p), LEVEL)
        m = key_value(pack_key(tl.load(scratch_row + GREEDY)))
        present = tl.zeros([_BINS], dtype=tl.int32)
        mass_row = scratch_row + MASSES + LEVEL * _BINS
        for start in range(lo, hi, BLOCK):
            _, mask, _, x = load_block(
                logits_row, marks_row, start, hi, rep, freq, pres, temp, PENALTIES, BANS, BLOCK
            )
            u = unsigned_keys(order_keys(x))
            chosen = mask & (u >= floor) & in_prefix(u, prefix, LEVEL)
            digits = digit(u, LEVEL)
            present += histogram(digits, chosen)
            mass = tl.floor(exp_weights(x - m) * _MASS).to(tl.int64)
            # NOTE: per-token atomics, but only for survivors: few once top-k or a level has cut.
            tl.atomic_add(mass_row + digits, mass, mask=chosen & (mass > 0))
        bins = tl.arange(0, _BINS)
        present_row = scratch_row + PRESENT + LEVEL * _BINS
        tl.atomic_add(present_row + bins, present.to(tl.int64), mask=present > 0)


@triton.jit
def race_pass(
    logits_ptr, logits_stride, floats_ptr, ints_ptr, marks_ptr, scratch_ptr, vocab, slice_len,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
    MIN_P: tl.constexpr, SURVIVORS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """argmax of weight / Exp(1) noise over the kept tokens, the lowest id among equals."""
    row, lo, hi = program_slice(vocab, slice_len)
    temp, top_p, min_p, rep, freq, pres = row_floats(floats_ptr, row)
    row_ints = ints_ptr + row * 5
    scratch_row = scratch_ptr + row * _SCRATCH
    gathered = tl.full((), 0, tl.int32)
    if TOP_K:
        gathered = top_k_floor(scratch_row, temp, tl.load(row_ints + 3), vocab, SURVIVORS)[1]
    if (temp > 0) & (gathered == 0):
        logits_row = logits_ptr + row * logits_stride
        marks_row = marks_ptr + row * vocab
        floor = kept_floor(scratch_row, tl.load(row_ints + 3), top_p, vocab, TOP_K, TOP_P)
        m = key_value(pack_key(tl.load(scratch_row + GREEDY)))
        row_key = row_noise_key(row_ints)
        best = tl.full((), 0, tl.int64)
        for start in range(lo, hi, BLOCK):
            ids, mask, _, x = load_block(
                logits_row, marks_row, start, hi, rep, freq, pres, temp, PENALTIES, BANS, BLOCK
            )
            weights = exp_weights(x - m)
            kept = mask & (unsigned_keys(order_keys(x)) >= floor)
            if MIN_P:
                kept = kept & (weights >= min_p)
            scores = race_scores(weights, ids, kept, row_key)
            best = tl.maximum(best, block_best(scores, ids))
        tl.atomic_max(scratch_row + RACE, best)
