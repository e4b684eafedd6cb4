"""The sampler as one Triton kernel: the fast path on CUDA, same contract as Sampler.

One program per row makes a few passes over its vocabulary (the logits stay in place; the
processed logit of a token is recomputed from the raw one in every pass):
0. penalties or min_tokens bans: the row's context ids are scattered into a zeroed int32
   scratch row (output count | seen | banned flags), cleared again at the end;
1. processed logits: max, greedy argmax, log-sum-exp (and the raw one for raw logprobs);
2. top logprobs: one pass per rank, each the largest (logit, -id) below the previous one;
3. truncation without a sort, a threshold search on the order keys: top-k finds the largest
   key T with count(keys >= T) >= k, top-p then the least key T whose mass strictly above is
   at most top_p times the top-k mass, WAYS thresholds per pass (log_WAYS of the key range);
4. the exponential race over the kept tokens.
Every decision uses engine/sampling/sampling_math.py's arithmetic with the same operations in
the same order (correctly rounded division, no fused multiply-add; its exp, log and hash as
Triton functions in engine/sampling/fused_math.py), so the kernel picks exactly the tokens the
torch Sampler picks; logprobs agree to float32 rounding.

The kernel also runs under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, which is
how the tests check it against the torch Sampler.
"""

# ruff: noqa: SIM102  (a constexpr `if` and a runtime `if` do not merge into one in Triton)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.sampling import sampling_math as sm
from engine.sampling.fused_math import exp_weights, fmix32, neg_log, order_keys
from engine.sampling.sampler import SamplerOutput, SamplingBatch

SEEN = 1 << 24  # scratch flags above a 24-bit output count
BANNED = 1 << 25

_MASS = tl.constexpr(sm.MASS_SCALE)
_U_MAX = tl.constexpr(sm.U_MAX)
_SEEN = tl.constexpr(SEEN)
_BANNED = tl.constexpr(BANNED)


@triton.jit
def _processed(raw, marks, rep, freq, pres, temp, PENALTIES: tl.constexpr, BANS: tl.constexpr):
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
def _scatter_ids(
    ids_ptr, width, marks_row, vocab, start_pos, flag, COUNT: tl.constexpr, BLOCK: tl.constexpr
):
    for start in range(0, width, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + pos, mask=pos < width, other=vocab)
        valid = ids < vocab
        tl.atomic_or(marks_row + ids, flag, mask=valid)
        if COUNT:
            tl.atomic_add(marks_row + ids, 1, mask=valid & (pos >= start_pos))


@triton.jit
def _clear_ids(ids_ptr, width, marks_row, vocab, BLOCK: tl.constexpr):
    for start in range(0, width, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + pos, mask=pos < width, other=vocab)
        tl.store(marks_row + ids, 0, mask=ids < vocab)


@triton.jit
def _sample(
    logits_ptr, logits_stride, floats_ptr, ints_ptr,
    ctx_ptr, ctx_stride, ctx_width, ban_ptr, ban_stride, ban_width,
    marks_ptr, raw_rows_ptr, out_ptr, vocab,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, MARKS: tl.constexpr, SAMPLE: tl.constexpr,
    TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
    LOGPROBS: tl.constexpr, RAW: tl.constexpr, NUM_TOP: tl.constexpr,
    BLOCK: tl.constexpr, WAYS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    marks_row = marks_ptr + row * vocab
    temp = tl.load(floats_ptr + row * 6)
    top_p = tl.load(floats_ptr + row * 6 + 1)
    min_p = tl.load(floats_ptr + row * 6 + 2)
    rep = tl.load(floats_ptr + row * 6 + 3)
    freq = tl.load(floats_ptr + row * 6 + 4)
    pres = tl.load(floats_ptr + row * 6 + 5)
    top_k = tl.load(ints_ptr + row * 5 + 3)
    divisor = tl.where(temp > 0, temp, 1.0)

    # 0. Marks: output counts, seen and banned flags.
    if PENALTIES:
        start_pos = tl.load(ints_ptr + row * 5 + 4)
        ctx_row = ctx_ptr + row * ctx_stride
        _scatter_ids(ctx_row, ctx_width, marks_row, vocab, start_pos, _SEEN, True, BLOCK)
    if BANS:
        ban_row = ban_ptr + row * ban_stride
        _scatter_ids(ban_row, ban_width, marks_row, vocab, 0, _BANNED, False, BLOCK)
    if MARKS:
        tl.debug_barrier()  # every flag is set before any pass reads one

    # 1. Max, greedy argmax, key range, log-sum-exps.
    offs = tl.arange(0, BLOCK)
    m = -3.4e38
    greedy = tl.full((), 0, tl.int32)
    total = 0.0
    raw_m = -3.4e38
    raw_total = 0.0
    key_min = 2147483647  # the least key: the search's floor (every key when no truncation)
    if not (TOP_K or TOP_P):
        key_min = -2147483647 - 1
    for start in range(0, vocab, BLOCK):
        mask = start + offs < vocab
        raw = tl.load(logits_row + start + offs, mask=mask, other=float("-inf"))
        marks = 0
        if MARKS:
            marks = tl.load(marks_row + start + offs, mask=mask, other=0, cache_modifier=".cg")
        x = _processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS)
        x = tl.where(mask, x, float("-inf"))
        block_max = tl.max(x, axis=0)
        greedy = tl.where(block_max > m, start + tl.argmax(x, axis=0, tie_break_left=True), greedy)
        new_m = tl.maximum(m, block_max)
        if LOGPROBS:
            total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        if RAW:
            new_raw_m = tl.maximum(raw_m, tl.max(raw, axis=0))
            raw_total = raw_total * tl.exp(raw_m - new_raw_m) + tl.sum(
                tl.exp(raw - new_raw_m), axis=0
            )
            raw_m = new_raw_m
        m = new_m
        if TOP_K or TOP_P:
            keys = tl.where(mask, order_keys(x), 2147483647)
            key_min = tl.minimum(key_min, tl.min(keys, axis=0))
    log_total = 0.0
    if LOGPROBS:
        log_total = tl.log(total)
    raw_log_total = 0.0
    if RAW:
        raw_log_total = tl.log(raw_total)
    is_raw = False
    if RAW:
        is_raw = True
        if LOGPROBS:
            is_raw = tl.load(raw_rows_ptr + row) != 0
    out_width = 2 + 2 * NUM_TOP

    # 2. Top logprobs: (order key, -id) packed in an int64, one rank per pass.
    previous = 9223372036854775807
    low_mask = tl.full((), 4294967295, tl.int64)
    for rank in tl.static_range(NUM_TOP):
        best = tl.full((), -9223372036854775807 - 1, tl.int64)
        for start in range(0, vocab, BLOCK):
            mask = start + offs < vocab
            raw = tl.load(logits_row + start + offs, mask=mask, other=float("-inf"))
            marks = 0
            if MARKS:
                marks = tl.load(marks_row + start + offs, mask=mask, other=0, cache_modifier=".cg")
            x = _processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS)
            source = x
            if RAW:
                source = tl.where(is_raw, raw, x)
            ids = (start + offs).to(tl.int64)
            ranked = order_keys(source).to(tl.int64) * 4294967296 + (low_mask - ids)
            ranked = tl.where(mask & (ranked < previous), ranked, -9223372036854775807 - 1)
            best = tl.maximum(best, tl.max(ranked, axis=0))
        previous = best
        token = low_mask - (best & low_mask)
        key = (best >> 32).to(tl.int32)
        value = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
        logprob = value - m - log_total
        if RAW:
            logprob = tl.where(is_raw, value - raw_m - raw_log_total, logprob)
        tl.store(out_ptr + row * out_width + 2 + rank, token.to(tl.float64))
        tl.store(out_ptr + row * out_width + 2 + NUM_TOP + rank, logprob.to(tl.float64))

    # 3-4. Truncation thresholds, then the race.
    token = greedy
    if SAMPLE:
        if temp > 0:
            threshold = _threshold(
                logits_row, marks_row, rep, freq, pres, divisor, m, key_min, top_k, top_p,
                vocab, PENALTIES, BANS, TOP_K, TOP_P, BLOCK, WAYS,
            )  # fmt: skip
            token = _race(
                logits_row, marks_row, ints_ptr + row * 5, rep, freq, pres, divisor, m,
                threshold, min_p, vocab, PENALTIES, BANS, MIN_P, BLOCK,
            )  # fmt: skip

    if LOGPROBS or RAW:
        raw = tl.load(logits_row + token)
        marks = 0
        if MARKS:
            marks = tl.load(marks_row + token, cache_modifier=".cg")
        x = _processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS)
        logprob = x - m - log_total
        if RAW:
            logprob = tl.where(is_raw, raw - raw_m - raw_log_total, logprob)
        tl.store(out_ptr + row * out_width, token.to(tl.float64))
        tl.store(out_ptr + row * out_width + 1, logprob.to(tl.float64))
    else:
        tl.store(out_ptr + row, token.to(tl.int64))

    if MARKS:
        tl.debug_barrier()  # every pass has read its flags
        if PENALTIES:
            _clear_ids(ctx_row, ctx_width, marks_row, vocab, BLOCK)
        if BANS:
            _clear_ids(ban_row, ban_width, marks_row, vocab, BLOCK)


@triton.jit
def _threshold(
    logits_row, marks_row, rep, freq, pres, divisor, m, key_min, top_k, top_p, vocab,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
    BLOCK: tl.constexpr, WAYS: tl.constexpr,
):  # fmt: skip
    """The least order key the row keeps (Sampler._threshold), by WAYS-ary search."""
    offs = tl.arange(0, BLOCK)
    ways = tl.arange(0, WAYS).to(tl.int64)
    lo = key_min.to(tl.int64)
    key_max = order_keys(m).to(tl.int64)
    if TOP_K:
        if top_k > 0:
            if top_k < vocab:
                # Largest T with count(keys >= T) >= k: invariant count(lo) >= k > count(hi + 1).
                hi = key_max
                while lo < hi:
                    points = lo + 1 + ((hi - lo - 1) * (ways + 1)) // WAYS  # in (lo, hi]
                    counts = tl.zeros([WAYS], dtype=tl.int32)
                    for start in range(0, vocab, BLOCK):
                        mask = start + offs < vocab
                        keys = _block_keys(
                            logits_row, marks_row, start, mask, rep, freq, pres, divisor,
                            PENALTIES, BANS, BLOCK,
                        ).to(tl.int64)  # fmt: skip
                        hit = (keys[:, None] >= points[None, :]) & mask[:, None]
                        counts += tl.sum(hit.to(tl.int32), axis=0)
                    ok = counts >= top_k
                    new_lo = tl.max(tl.where(ok, points, lo), axis=0)
                    hi = tl.min(tl.where(ok, hi, points - 1), axis=0)
                    lo = new_lo
    if TOP_P:
        if top_p < 1.0:
            # Least T >= top-k's with mass(keys > T) <= top_p * mass(keys >= top-k's).
            k_floor = lo
            hi = key_max
            while lo < hi:
                points = lo + ((hi - lo) * ways) // WAYS  # in [lo, hi)
                above = tl.zeros([WAYS], dtype=tl.int64)
                kept_mass = tl.zeros([BLOCK], dtype=tl.int64)
                for start in range(0, vocab, BLOCK):
                    mask = start + offs < vocab
                    raw = tl.load(logits_row + start + offs, mask=mask, other=float("-inf"))
                    marks = 0
                    if PENALTIES or BANS:
                        marks = tl.load(
                            marks_row + start + offs, mask=mask, other=0, cache_modifier=".cg"
                        )
                    x = _processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS)
                    keys = order_keys(x).to(tl.int64)
                    mass = tl.floor(exp_weights(x - m) * _MASS).to(tl.int64)
                    mass = tl.where(mask & (keys >= k_floor), mass, 0)
                    kept_mass += mass
                    hit = keys[:, None] > points[None, :]
                    above += tl.sum(tl.where(hit, mass[:, None], 0), axis=0)
                limit = top_p.to(tl.float64) * tl.sum(kept_mass, axis=0).to(tl.float64)
                ok = above.to(tl.float64) <= limit
                hi = tl.min(tl.where(ok, points, hi), axis=0)
                lo = tl.max(tl.where(ok, lo, points + 1), axis=0)
    return lo


@triton.jit
def _block_keys(
    logits_row, marks_row, start, mask, rep, freq, pres, divisor,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = start + tl.arange(0, BLOCK)
    raw = tl.load(logits_row + offs, mask=mask, other=float("-inf"))
    marks = 0
    if PENALTIES or BANS:
        marks = tl.load(marks_row + offs, mask=mask, other=0, cache_modifier=".cg")
    return order_keys(_processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS))


@triton.jit
def _race(
    logits_row, marks_row, row_ints, rep, freq, pres, divisor, m, threshold, min_p, vocab,
    PENALTIES: tl.constexpr, BANS: tl.constexpr, MIN_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """argmax of weight / Exp(1) noise over the kept tokens, the lowest id among equals."""
    seed_low = tl.load(row_ints).to(tl.uint32)
    seed_high = tl.load(row_ints + 1).to(tl.uint32)
    counter = (tl.load(row_ints + 2) & 4294967295).to(tl.uint32)
    row_key = fmix32(seed_high ^ fmix32(seed_low ^ fmix32(counter)))
    offs = tl.arange(0, BLOCK)
    best = -1.0
    token = 0
    for start in range(0, vocab, BLOCK):
        mask = start + offs < vocab
        raw = tl.load(logits_row + start + offs, mask=mask, other=float("-inf"))
        marks = 0
        if PENALTIES or BANS:
            marks = tl.load(marks_row + start + offs, mask=mask, other=0, cache_modifier=".cg")
        x = _processed(raw, marks, rep, freq, pres, divisor, PENALTIES, BANS)
        weights = exp_weights(x - m)
        kept = mask & (order_keys(x) >= threshold)
        if MIN_P:
            kept = kept & (weights >= min_p)
        bits = fmix32(row_key ^ ((start + offs).to(tl.uint32) * 0x9E3779B9))
        u = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08, _U_MAX)
        scores = tl.where(kept, tl.math.div_rn(weights, neg_log(u)), -1.0)
        block_best = tl.max(scores, axis=0)
        token = tl.where(
            block_best > best, start + tl.argmax(scores, 0, tie_break_left=True), token
        )
        best = tl.maximum(best, block_best)
    return token


class FusedSampler:
    """Sampler's contract in one kernel launch (plus the output's allocation).

    `block` tokens per iteration and `ways` thresholds per search pass; the scratch for
    penalty and ban marks ([rows, vocab] int32, zero between calls) is allocated on the first
    step that needs it and grows with the batch.
    """

    def __init__(self, block: int = 1024, ways: int = 8, num_warps: int = 8) -> None:
        self.block = block
        self.ways = ways
        self.num_warps = num_warps
        self._marks: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        rows, vocab = logits.shape
        assert logits.stride(1) == 1 and batch.floats.is_contiguous()
        assert batch.ints.is_contiguous()
        penalties = batch.use_penalties
        bans = batch.suppress_ids is not None
        marks = self._scratch(rows, vocab, logits.device) if penalties or bans else logits
        ctx = batch.context_ids if batch.context_ids is not None else batch.ints
        ban = batch.suppress_ids if batch.suppress_ids is not None else batch.ints
        raw = batch.raw_logprobs
        wants_logprobs = batch.logprobs or raw
        k = batch.num_top_logprobs
        if wants_logprobs:
            out = torch.empty(rows, 2 + 2 * k, dtype=torch.float64, device=logits.device)
        else:
            out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        raw_rows = batch.raw_rows if batch.raw_rows is not None else batch.ints
        self.launch(
            (rows,),
            logits, logits.stride(0), batch.floats, batch.ints,
            ctx, ctx.stride(0), ctx.shape[1], ban, ban.stride(0), ban.shape[1],
            marks, raw_rows, out, vocab,
            PENALTIES=penalties, BANS=bans, MARKS=penalties or bans, SAMPLE=not batch.all_greedy,
            TOP_K=batch.use_top_k, TOP_P=batch.use_top_p, MIN_P=batch.use_min_p,
            LOGPROBS=batch.logprobs, RAW=raw, NUM_TOP=k, BLOCK=self.block, WAYS=self.ways,
            num_warps=self.num_warps,
            # NOTE: a contracted a * b + c rounds once, torch's twice: the tokens could differ.
            enable_fp_fusion=False,
        )  # fmt: skip
        return SamplerOutput(out, k if wants_logprobs else 0)

    @staticmethod
    def launch(grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
        """The one kernel launch of a step (a separate method so tools can count it)."""
        _sample[grid](*args, **kwargs)

    def _scratch(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        marks = self._marks
        if marks is None or marks.shape[0] < rows or marks.shape[1] != vocab:
            marks = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
            self._marks = marks
        return marks
