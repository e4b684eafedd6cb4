"""engine/sampling/sampling_math.py's arithmetic as Triton device functions, for the fused kernel.

The same float32 operations in the same order as the torch functions there: the order keys
(`order_keys`), the exponential weights (`exp_weights`), the Exp(1) noise's -log
(`neg_log`) and the counter-based hash (`fmix32`). `math_kernel` applies the first two
elementwise, so the tests can compare them bit for bit with the torch ones.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.sampling import sampling_math as sm

_LOG2E = tl.constexpr(sm.LOG2E)
_LN2 = tl.constexpr(sm.LN2)
_SQRT2 = tl.constexpr(sm.SQRT2)
_MIN_EXP = tl.constexpr(sm.MIN_EXPONENT)
_E1, _E2, _E3, _E4, _E5, _E6 = (tl.constexpr(c) for c in sm.EXP2_COEFFS)
_A3, _A5, _A7, _A9 = (tl.constexpr(c) for c in sm.ATANH_COEFFS)


@triton.jit
def order_keys(x):
    bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def exp_weights(d):
    t = tl.maximum(d, _MIN_EXP) * _LOG2E
    n = tl.floor(t)
    f = t - n
    p = f * _E6 + _E5
    p = p * f + _E4
    p = p * f + _E3
    p = p * f + _E2
    p = p * f + _E1
    p = p * f + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(d < _MIN_EXP, 0.0, p * scale)


@triton.jit
def neg_log(u):
    bits = u.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > _SQRT2
    m = tl.where(big, m * 0.5, m)
    exponent = exponent + big.to(tl.int32)
    r = m - 1.0
    s = tl.math.div_rn(r, r + 2.0)
    z = s * s
    p = z * _A9 + _A7
    p = p * z + _A5
    p = p * z + _A3
    s2 = s + s
    log_m = s2 + s2 * (z * p)
    return -(exponent.to(tl.float32) * _LN2 + log_m)


@triton.jit
def fmix32(x):  # uint32
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _apply_math(d_ptr, u_ptr, w_ptr, e_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(w_ptr + offs, exp_weights(tl.load(d_ptr + offs, mask=mask)), mask=mask)
    tl.store(e_ptr + offs, neg_log(tl.load(u_ptr + offs, mask=mask, other=0.5)), mask=mask)


def math_kernel() -> triton.JITFunction:
    """w = exp_weights(d) and E = neg_log(u) elementwise: the tests compare them bit for bit
    with engine/sampling/sampling_math.py's."""
    return _apply_math
