"""The fused sampler's per-block device functions: a row's parameters, its processed logits
(the torch Sampler's operations in its order), the penalty marks, and the packed int64 values
that atomics and merges compare.

Packing: a (key, token) pair becomes one non-negative int64, (key + 2^31) * 2^31 + (2^31 - 1 -
token), so that the larger key wins and, among equal keys, the lower token id; 0 is below every
pack, so a zeroed scratch slot is a valid start for `atomic_max`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling.fused_math import order_keys

SEEN = 1 << 24  # mark flags above a 24-bit output count
BANNED = 1 << 25
_SEEN = tl.constexpr(SEEN)
_BANNED = tl.constexpr(BANNED)
_HALF = tl.constexpr(1 << 31)


@triton.jit
def program_slice(vocab, slice_len):
    """(row, first token, end): program (row, split)'s tokens."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * slice_len
    return row, lo, tl.minimum(lo + slice_len, vocab)


@triton.jit
def row_floats(floats_ptr, row):
    """(temperature, top_p, min_p, repetition, frequency, presence): SamplingBatch.floats."""
    base = floats_ptr + row * 6
    return (
        tl.load(base),
        tl.load(base + 1),
        tl.load(base + 2),
        tl.load(base + 3),
        tl.load(base + 4),
        tl.load(base + 5),
    )


@triton.jit
def processed(raw, marks, rep, freq, pres, temp, PENALTIES: tl.constexpr, BANS: tl.constexpr):
    """The row's processed logits, the torch Sampler's operations in its order."""
    x = raw
    if PENALTIES:
        count = (marks & 0xFFFFFF).to(tl.float32)
        penalised = tl.where(raw > 0, tl.math.div_rn(raw, rep), raw * rep)
        x = tl.where((marks & _SEEN) != 0, penalised, raw)
        x = x - freq * count
        x = x - pres * (count > 0).to(tl.float32)
    if BANS:
        x = tl.where((marks & _BANNED) != 0, float("-inf"), x)
    return tl.math.div_rn(x, temp)


@triton.jit
def load_block(
    logits_row, marks_row, start, hi, rep, freq, pres, divisor,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """(ids, mask, raw, processed) of tokens [start, start + BLOCK) below hi, in float32
    whatever the logits' dtype (the torch Sampler upcasts at the same point); -inf outside."""
    ids = start + tl.arange(0, BLOCK)
    mask = ids < hi
    raw = tl.load(logits_row + ids, mask=mask, other=float("-inf")).to(tl.float32)
    marks = 0
    if PENALTIES or BANS:
        marks = tl.load(marks_row + ids, mask=mask, other=0, cache_modifier=".cg")
    x = processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS)
    return ids, mask, raw, tl.where(mask, x, float("-inf"))


@triton.jit
def load_one(
    logits_row, marks_row, token, rep, freq, pres, divisor,
    PENALTIES: tl.constexpr, BANS: tl.constexpr,
):  # fmt: skip
    """(raw, processed) logit of one token."""
    raw = tl.load(logits_row + token).to(tl.float32)
    marks = 0
    if PENALTIES or BANS:
        marks = tl.load(marks_row + token, cache_modifier=".cg")
    return raw, processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS)


@triton.jit
def pack(key, token):
    """(int32 key, token id) -> int64, ordered by key, then by the lower id."""
    return (key.to(tl.int64) + _HALF) * _HALF + (2147483647 - token.to(tl.int64))


@triton.jit
def pack_key(packed):
    return ((packed >> 31) - _HALF).to(tl.int32)


@triton.jit
def pack_token(packed):
    return (2147483647 - (packed & 2147483647)).to(tl.int32)


@triton.jit
def key_value(key):
    """The float32 whose order key is `key` (+0 for the key of +-0)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def block_best(x, ids):
    """The block's largest (order key, -id) pack: its argmax with the lowest id among equals."""
    return tl.max(pack(order_keys(x), ids), axis=0)


@triton.jit
def scatter_ids(
    ids_ptr, width, marks_row, lo, hi, start_pos, flag, COUNT: tl.constexpr, BLOCK: tl.constexpr
):
    """Marks the ids in [lo, hi) of one row's id list (padded with ids >= vocab)."""
    for start in range(0, width, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + pos, mask=pos < width, other=hi)
        valid = (ids >= lo) & (ids < hi)
        tl.atomic_or(marks_row + ids, flag, mask=valid)
        if COUNT:
            tl.atomic_add(marks_row + ids, 1, mask=valid & (pos >= start_pos))


@triton.jit
def clear_ids(ids_ptr, width, marks_row, vocab, BLOCK: tl.constexpr):
    for start in range(0, width, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + pos, mask=pos < width, other=vocab)
        tl.store(marks_row + ids, 0, mask=ids < vocab)
