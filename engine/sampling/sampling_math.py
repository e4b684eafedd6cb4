"""The sampler's decision arithmetic, reproducible bit for bit by any implementation.

Which token a sampled row draws must not depend on how a float reduction was ordered or on
whose `exp` or `log` ran, so that the fused CUDA kernels (engine/sampling/fused_sampler.py) pick
exactly the token this torch code picks. Every value a decision reads is therefore built from
correctly rounded float32 `+ - * /`, comparisons, float<->int conversions and integer ops:
- `exp_weights`: w = exp(x - max) by a fixed polynomial for 2^f and an exponent built from
  bits (never subnormal: below e^-80 it is 0);
- `exponential_noise`: E = -log(u) by a fixed atanh series, u from the counter-based hash,
  below 1 so that E > 0;
- masses for top-p: q = floor(w * 2^32) summed as int64 (order-free), compared with top_p in
  float64;
- the order of tokens: `order_keys`, int32 keys ordered as the float values.
Implementations must not contract `a * b + c` into a fused multiply-add (the Triton kernel is
launched with fp fusion off). The logprobs callers get are not decisions: they come from the
ordinary log-softmax and may differ between implementations in the last bits.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
LOG2E = 1.4426950216293335  # float32(log2(e)): every constant here is a float32 value
LN2 = 0.6931471824645996  # float32(ln 2)
SQRT2 = 1.4142135381698608  # float32(sqrt 2)
# 2^f ~ 1 + f * (c1 + f * (c2 + ...)) on [0, 1), relative error ~1e-7 (least squares, degree 6).
EXP2_COEFFS = (
    0.6931470632553101,
    0.24022932350635529,
    0.05548521876335144,
    0.009675536304712296,
    0.00124673405662179,
    0.00021613943681586534,
)
# log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172: 2 (s + s^3/3 + ... + s^9/9).
ATANH_COEFFS = (0.3333333432674408, 0.20000000298023224, 0.1428571492433548, 0.1111111119389534)
MIN_EXPONENT = -80.0  # exp_weights is 0 below e^-80: every weight stays a normal float32
MASS_SCALE = 4294967296.0  # 2^32: a top-p mass unit
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1: the uniform noise's ceiling


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered as the float32 values (-0 and +0 share a key; -inf is the least)."""
    bits = torch.where(x == 0, 0.0, x).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def top_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k] ids of each row's k largest values, most likely first, equal values by id.

    On the CPU, torch's float topk (20x faster than ranking int64 keys over the vocabulary)
    gives the k largest values; only its order among equal values is arbitrary. So the k are
    reordered by (value, id), and a row where a value equal to the k-th one was left out (the
    k+1-th largest equals the k-th) is ranked by keys. Elsewhere keys rank every row: checking
    for such rows would wait for the device."""
    vocab = x.shape[-1]
    if x.device.type != "cpu":
        return _ranked_ids(x, k)
    values, ids = x.topk(min(k + 1, vocab), dim=-1)
    straddles = values[:, k] == values[:, k - 1] if k < vocab else None
    values, ids = values[:, :k], ids[:, :k]
    keys = order_keys(values).long() * (MASK32 + 1) + (MASK32 - ids)
    ids = ids.gather(-1, keys.argsort(dim=-1, descending=True))
    if straddles is not None and bool(straddles.any()):
        rows = straddles.nonzero()[:, 0]
        ids[rows] = _ranked_ids(x[rows], k)
    return ids


def _ranked_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """top_ids by distinct int64 keys (value, then the lower id) over the whole vocabulary."""
    ids = torch.arange(x.shape[-1], device=x.device)
    ranked = order_keys(x).long() * (MASK32 + 1) + (MASK32 - ids)  # distinct
    return ranked.topk(k, dim=-1).indices


def exp_weights(d: torch.Tensor) -> torch.Tensor:
    """exp(d) for d <= 0 (d = logit - row max): 1 at d = 0, 0 below MIN_EXPONENT."""
    t = d.clamp(min=MIN_EXPONENT) * LOG2E
    n = torch.floor(t)
    f = t - n  # exact, in [0, 1)
    p = torch.full_like(f, EXP2_COEFFS[-1])
    for c in EXP2_COEFFS[-2::-1]:
        p = p * f + c
    p = p * f + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n, n >= -116
    return torch.where(d < MIN_EXPONENT, 0.0, p * scale)


def neg_log(u: torch.Tensor) -> torch.Tensor:
    """-log(u) for normal u in (0, 1): positive, never 0."""
    bits = u.view(torch.int32)
    exponent = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)  # [0.707, 1.414]
    exponent = exponent + big.to(torch.int32)
    r = m - 1.0  # exact (Sterbenz)
    s = r / (r + 2.0)
    z = s * s
    p = torch.full_like(z, ATANH_COEFFS[-1])
    for c in ATANH_COEFFS[-2::-1]:
        p = p * z + c
    s2 = s + s
    log_m = s2 + s2 * (z * p)
    return -(exponent.to(torch.float32) * LN2 + log_m)


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 without int64 overflow: split c into 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def row_hash(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[rows] int64 < 2**32: each row's hash of its seed (low, high 32 bits) and counter."""
    return fmix32(seeds[:, 1] ^ fmix32(seeds[:, 0] ^ fmix32(counters & MASK32)))


def uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [rows, vocab], a pure function of (seed, counter, token id):
    (k + 0.5) * 2^-24 for the hash's top 24 bits k, in float32, at most U_MAX, so -log(u) is
    finite and positive. (k = 2^24 - 1 rounds to 1 in float32: its noise would be 0, and a
    weight divided by 0 is inf, or NaN for a weight of 0, which argmax would pick.)"""
    row = row_hash(seeds, counters)
    # Token ids times an odd constant (a bijection mod 2**32) spread over all 32 bits; one
    # finaliser round over [rows, vocab], the one tensor that is large.
    cols = mul32(torch.arange(vocab, device=seeds.device), 0x9E3779B9)
    bits = fmix32(row[:, None] ^ cols[None, :])
    return (((bits >> 8).float() + 0.5) * (1.0 / float(1 << 24))).clamp(max=U_MAX)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] for the exponential race."""
    return neg_log(uniform(seeds, counters, vocab))
