"""Top-p and the race among top-k's survivors, gathered: no more passes over the vocabulary.

Once top-k's threshold is known (engine/sampling/fused_select.py), a row whose survivors (k
and the k-th's ties) fit in SURVIVORS slots is finished on them alone: `gather_pass` copies
each slice's survivors, as (key, token) packs, into the row's list (in any order: an atomic
counter hands out the slots), and `survivors_race`, one program per row, sorts them and
does what Sampler._threshold and Sampler._race do on the sorted row: the masses' exclusive
cumulative sum, the top-p cut, min-p, the race. The processed logit is the key's float
exactly, so every decision reads the same values as there. Rows with more survivors take the
radix path (mass_pass, race_pass), which skip the gathered ones.
"""

# ruff: noqa: SIM102  (a constexpr `if` and a runtime `if` do not merge into one in Triton)
from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling import sampling_math as sm
from engine.sampling.fused_blocks import (
    key_value,
    load_block,
    pack,
    pack_key,
    pack_token,
    program_slice,
    row_floats,
)
from engine.sampling.fused_math import exp_weights, fmix32, neg_log, order_keys
from engine.sampling.fused_select import (
    COUNTS,
    GATHERED,
    GREEDY,
    RACE,
    SCRATCH,
    top_k_survivors,
    unsigned_keys,
)

_MASS = tl.constexpr(sm.MASS_SCALE)
_U_MAX = tl.constexpr(sm.U_MAX)
_SCRATCH = tl.constexpr(SCRATCH)
_MIN64 = tl.constexpr(-(1 << 63))


@triton.jit
def top_k_floor(scratch_row, temp, top_k, vocab, SURVIVORS: tl.constexpr):
    """(top-k's least kept u, 1 if the row's survivors are gathered else 0)."""
    floor = tl.full((), 0, tl.int64)
    gathered = tl.full((), 0, tl.int32)
    if (temp > 0) & (top_k > 0) & (top_k < vocab):
        floor, kept = top_k_survivors(scratch_row + COUNTS, top_k)
        gathered = (kept <= SURVIVORS).to(tl.int32)
    return floor, gathered


@triton.jit
def row_noise_key(row_ints):
    """The row's key for the counter-based noise (sampling_math.uniform's `row`)."""
    seed_low = tl.load(row_ints).to(tl.uint32)
    seed_high = tl.load(row_ints + 1).to(tl.uint32)
    counter = (tl.load(row_ints + 2) & 4294967295).to(tl.uint32)
    return fmix32(seed_high ^ fmix32(seed_low ^ fmix32(counter)))


@triton.jit
def race_scores(weights, ids, kept, row_key):
    """weight / Exp(1) noise of the kept tokens, -1 elsewhere."""
    bits = fmix32(row_key ^ (ids.to(tl.uint32) * 0x9E3779B9))
    u = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08, _U_MAX)
    return tl.where(kept, tl.math.div_rn(weights, neg_log(u)), -1.0)


@triton.jit
def gather_pass(
    logits_ptr, logits_stride, floats_ptr, ints_ptr, marks_ptr, scratch_ptr, cands_ptr,
    vocab, slice_len,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, SURVIVORS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, lo, hi = program_slice(vocab, slice_len)
    temp, _, _, rep, freq, pres = row_floats(floats_ptr, row)
    scratch_row = scratch_ptr + row * _SCRATCH
    floor, gathered = top_k_floor(
        scratch_row, temp, tl.load(ints_ptr + row * 5 + 3), vocab, SURVIVORS
    )
    if gathered != 0:
        logits_row = logits_ptr + row * logits_stride
        marks_row = marks_ptr + row * vocab
        for start in range(lo, hi, BLOCK):
            ids, mask, _, x = load_block(
                logits_row, marks_row, start, hi, rep, freq, pres, temp, PENALTIES, BANS, BLOCK
            )
            keys = order_keys(x)
            chosen = mask & (unsigned_keys(keys) >= floor)
            n = tl.sum(chosen.to(tl.int64), axis=0)
            if n > 0:
                first = tl.atomic_add(scratch_row + GATHERED, n)
                at = first + tl.cumsum(chosen.to(tl.int64), axis=0) - 1
                tl.store(cands_ptr + row * SURVIVORS + at, pack(keys, ids), mask=chosen)


@triton.jit
def survivors_race(
    floats_ptr, ints_ptr, scratch_ptr, cands_ptr, vocab,
    TOP_P: tl.constexpr, MIN_P: tl.constexpr, SURVIVORS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    temp, top_p, min_p, _, _, _ = row_floats(floats_ptr, row)
    row_ints = ints_ptr + row * 5
    scratch_row = scratch_ptr + row * _SCRATCH
    _, gathered = top_k_floor(scratch_row, temp, tl.load(row_ints + 3), vocab, SURVIVORS)
    if gathered != 0:
        slots = tl.arange(0, SURVIVORS)
        valid = slots < tl.load(scratch_row + GATHERED)
        packs = tl.load(cands_ptr + row * SURVIVORS + slots, mask=valid, other=_MIN64)
        packs = tl.sort(packs, 0, descending=True)  # by key, then by id; the padding last
        keys = pack_key(packs)
        ids = pack_token(packs)
        m = key_value(pack_key(tl.load(scratch_row + GREEDY)))
        weights = tl.where(valid, exp_weights(key_value(keys) - m), 0.0)
        kept = valid
        if TOP_P:
            if top_p < 1.0:
                mass = tl.floor(weights * _MASS).to(tl.int64)
                above = tl.cumsum(mass, axis=0) - mass
                limit = top_p.to(tl.float64) * tl.sum(mass, axis=0).to(tl.float64)
                count = tl.sum((valid & (above.to(tl.float64) <= limit)).to(tl.int32), axis=0)
                threshold = tl.sum(tl.where(slots == count - 1, keys, 0), axis=0)
                kept = valid & (keys >= threshold)
        if MIN_P:
            kept = kept & (weights >= min_p)
        scores = race_scores(weights, ids, kept, row_noise_key(row_ints))
        tl.store(scratch_row + RACE, tl.max(pack(order_keys(scores), ids), axis=0))
