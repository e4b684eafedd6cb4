/* A decode layer's norms and activation on the CPU, each one pass over its rows: RMSNorm with
 * the residual add before it, and SiLU(gate) * up. float32 or bfloat16 tensors, float32
 * arithmetic, rounded to the tensor dtype where transformers' torch code rounds (so that
 * bfloat16 results match it to the last bit but for the order of the variance's sum).
 *
 * Built and loaded by engine/layers/native.py; wrapped by engine/layers/cpu_ops.py, which says
 * the layouts: row-major rows `stride` elements apart, the last dim contiguous. Element access
 * and rounding: cpu_dtypes.h.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_dtypes.h"

/* One row r: out = weight * rms_normalise(x + residual); stream = x + residual (with `add`;
 * without it residual and stream are not read or written). The sum is rounded to the dtype
 * before it is normalised, the normalised value before the weight multiplies it, as
 * transformers does. */
static inline __attribute__((always_inline)) void rms_norm_row(
    int dtype, int add, const void *x, int64_t x_stride, const void *residual,
    int64_t r_stride, const void *weight, void *restrict out, void *stream, int64_t r,
    int64_t dim, float eps) {
    const int64_t xo = r * x_stride, ro = r * r_stride, oo = r * dim;
    const void *src = x;  /* the values to normalise: x, or the stream x + residual */
    int64_t so = xo;
    float sq = 0.f;
    if (add) {
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < dim; i++) {
            const float v = round_to(dtype, load(x, dtype, xo + i) + load(residual, dtype, ro + i));
            put(stream, dtype, oo + i, v);
            sq += v * v;
        }
        src = stream;
        so = oo;
    } else {
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < dim; i++) {
            const float v = load(x, dtype, xo + i);
            sq += v * v;
        }
    }
    const float inv = 1.f / sqrtf(sq / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        const float normalised = round_to(dtype, load(src, dtype, so + i) * inv);
        put(out, dtype, oo + i, load(weight, dtype, i) * normalised);
    }
}

/* NOTE: each kernel's row function is called with literal dtype (and flags) from inside its
 * parallel loop. GCC outlines an OpenMP region before it inlines, so a region inside an
 * always_inline function is outlined once, its dtype a variable: the bfloat16 rows then ran
 * 6x slower than float32's per element (a branch and no vector loop). */
void rms_norm(int dtype, const void *x, int64_t x_stride, const void *residual,
              int64_t r_stride, const void *weight, void *out, void *stream, int64_t rows,
              int64_t dim, float eps, int threads) {
#define NORM(DTYPE, ADD)                                                                     \
    rms_norm_row(DTYPE, ADD, x, x_stride, residual, r_stride, weight, out, stream, r, dim, eps)
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == F32 && residual) NORM(F32, 1);
        else if (dtype == F32) NORM(F32, 0);
        else if (residual) NORM(BF16, 1);
        else NORM(BF16, 0);
    }
#undef NORM
}

/* out = silu(gate) * up for one row, silu rounded to the dtype before the product (torch's
 * F.silu); where exp(-gate) overflows float32, silu is -0 as torch's is (-ffast-math assumes
 * finite values, so the overflow is not left to the division). For the loop to vectorise (a
 * scalar expf ran 2-4x slower than torch's silu on an AVX2 CPU): exp's argument is clamped and
 * the -0 chosen after it, not before (no call under a condition), and the dtype is a literal
 * (see rms_norm's note). */
static inline __attribute__((always_inline)) void silu_and_mul_row(
    int dtype, const void *gate, const void *up, int64_t in_offset, void *out,
    int64_t out_offset, int64_t dim) {
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        const float g = load(gate, dtype, in_offset + i);
        const float s = round_to(dtype, g / (1.f + expf(fminf(-g, 88.f))));
        const float silu = -g > 88.f ? -0.f : s;
        put(out, dtype, out_offset + i, silu * load(up, dtype, in_offset + i));
    }
}

void silu_and_mul(int dtype, const void *gate, const void *up, int64_t stride, void *out,
                  int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == F32)
            silu_and_mul_row(F32, gate, up, r * stride, out, r * dim, dim);
        else
            silu_and_mul_row(BF16, gate, up, r * stride, out, r * dim, dim);
    }
}
