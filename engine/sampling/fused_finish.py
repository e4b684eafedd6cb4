"""The fused sampler's merge step: one program per row, after the vocabulary passes.

It reads the row's winners (the greedy and race packs), merges the slices' partial
log-sum-exps (total = sum of t_s * exp(m_s - m), as split-K reductions merge) and top-logprob
candidates, writes the row's output (SamplerOutput's layout: NO_TOKEN for a row whose every
processed logit is -inf), and leaves the row's scratch and penalty marks zeroed for the next
call.
"""

# ruff: noqa: SIM102  (a constexpr `if` and a runtime `if` do not merge into one in Triton)
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling.fused_blocks import (
    clear_ids,
    key_value,
    load_one,
    pack_key,
    pack_token,
    row_floats,
)
from engine.sampling.fused_select import COUNTS, GATHERED, GREEDY, PRESENT, RACE, SCRATCH
from engine.sampling.sampler import NO_TOKEN

_SCRATCH = tl.constexpr(SCRATCH)
_MIN64 = tl.constexpr(-(1 << 63))
_NO_TOKEN = tl.constexpr(NO_TOKEN)


@triton.jit
def _merged_lse(parts_ptr, first, splits, COLUMN: tl.constexpr, CHUNK: tl.constexpr):
    """(max, log-sum-exp) over a row's slices from their (m_s, t_s) partials."""
    m = -3.4e38
    total = 0.0
    for start in range(0, splits, CHUNK):
        s = start + tl.arange(0, CHUNK)
        valid = s < splits
        at = parts_ptr + (first + s) * 4 + COLUMN
        ms = tl.load(at, mask=valid, other=-3.4e38)
        ts = tl.load(at + 1, mask=valid, other=0.0)
        new_m = tl.maximum(m, tl.max(ms, axis=0))
        total = total * tl.exp(m - new_m) + tl.sum(ts * tl.exp(ms - new_m), axis=0)
        m = new_m
    return m, tl.log(total)


@triton.jit
def finish(
    logits_ptr, logits_stride, floats_ptr, ctx_ptr, ctx_stride, ctx_width,
    ban_ptr, ban_stride, ban_width, marks_ptr, raw_rows_ptr, scratch_ptr, parts_ptr, tops_ptr,
    out_ptr, vocab, splits,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, SAMPLE: tl.constexpr, TOP_K: tl.constexpr,
    TOP_P: tl.constexpr, LOGPROBS: tl.constexpr, RAW: tl.constexpr, NUM_TOP: tl.constexpr,
    TOPB: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    marks_row = marks_ptr + row * vocab
    scratch_row = scratch_ptr + row * _SCRATCH
    temp, _, _, rep, freq, pres = row_floats(floats_ptr, row)
    divisor = tl.where(temp > 0, temp, 1.0)
    greedy = tl.load(scratch_row + GREEDY)
    token = pack_token(greedy)
    if SAMPLE:
        if temp > 0:
            token = pack_token(tl.load(scratch_row + RACE))
    # The row's max processed logit is -inf only when every one is: no token is possible.
    impossible = key_value(pack_key(greedy)) == float("-inf")
    out_id = tl.where(impossible, _NO_TOKEN, token)  # `token` stays a valid id: it is loaded

    if LOGPROBS or RAW:
        first = row * splits
        m, log_total = 0.0, 0.0
        if LOGPROBS:
            m, log_total = _merged_lse(parts_ptr, first, splits, 0, CHUNK)
        raw_m, raw_log_total = 0.0, 0.0
        if RAW:
            raw_m, raw_log_total = _merged_lse(parts_ptr, first, splits, 2, CHUNK)
        is_raw = False
        if RAW:
            is_raw = True
            if LOGPROBS:
                is_raw = tl.load(raw_rows_ptr + row) != 0
        out_row = out_ptr + row * (2 + 2 * NUM_TOP)
        raw, x = load_one(logits_row, marks_row, token, rep, freq, pres, divisor, PENALTIES, BANS)
        logprob = x - m - log_total
        if RAW:
            logprob = tl.where(is_raw, raw - raw_m - raw_log_total, logprob)
        tl.store(out_row, out_id.to(tl.float64))
        tl.store(out_row + 1, logprob.to(tl.float64))
        # Top logprobs: rank by rank, the largest candidate pack below the previous one.
        previous = 9223372036854775807
        count = splits * TOPB
        for rank in tl.static_range(NUM_TOP):
            best = tl.full((), _MIN64, tl.int64)
            for start in range(0, count, CHUNK):
                at = start + tl.arange(0, CHUNK)
                c = tl.load(tops_ptr + first * TOPB + at, mask=at < count, other=_MIN64)
                best = tl.maximum(best, tl.max(tl.where(c < previous, c, _MIN64), axis=0))
            previous = best
            value = key_value(pack_key(best))
            top_logprob = value - m - log_total
            if RAW:
                top_logprob = tl.where(is_raw, value - raw_m - raw_log_total, top_logprob)
            tl.store(out_row + 2 + rank, pack_token(best).to(tl.float64))
            tl.store(out_row + 2 + NUM_TOP + rank, top_logprob.to(tl.float64))
    else:
        tl.store(out_ptr + row, out_id.to(tl.int64))

    # Back to zero for the next call.
    tl.store(scratch_row + GREEDY, 0)
    tl.store(scratch_row + RACE, 0)
    if TOP_K:
        _zero(scratch_row + COUNTS, PRESENT - COUNTS, BLOCK)
        tl.store(scratch_row + GATHERED, 0)
    if TOP_P:
        _zero(scratch_row + PRESENT, GREEDY - PRESENT, BLOCK)
    if PENALTIES or BANS:
        tl.debug_barrier()  # the token's marks are read
        if PENALTIES:
            clear_ids(ctx_ptr + row * ctx_stride, ctx_width, marks_row, vocab, BLOCK)
        if BANS:
            clear_ids(ban_ptr + row * ban_stride, ban_width, marks_row, vocab, BLOCK)


@triton.jit
def _zero(ptr, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        tl.store(ptr + at, tl.zeros([BLOCK], dtype=tl.int64), mask=at < n)
