/* The sampler's exp weights, exponential race and greedy argmax on the CPU, each one pass
 * over [rows, vocab] with no temporaries: the arithmetic of engine/sampling/sampling_math.py
 * (exp_weights, uniform, neg_log), Sampler._race and torch.argmax, operation for operation in
 * float32 and uint32, so the results equal the torch reference bit for bit. Built WITHOUT
 * -ffast-math and with -ffp-contract=off (engine/layers/native.py's exact flags): no
 * reassociation, no fused multiply-add. Wrapped by engine/sampling/cpu_race.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LOG2E 1.4426950216293335f
#define LN2 0.6931471824645996f
#define SQRT2 1.4142135381698608f
#define MIN_EXPONENT (-80.0f)
#define U_MAX 0.99999994039535522f /* 1 - 2^-24 */

static inline float f32(int32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline int32_t bits32(float f) {
    int32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* exp(d) for d = x - row max <= 0: sampling_math.exp_weights. */
static inline float exp_weight(float d) {
    const float t = (d < MIN_EXPONENT ? MIN_EXPONENT : d) * LOG2E;
    const float n = floorf(t);
    const float f = t - n;
    float p = 0.00021613943681586534f;
    p = p * f + 0.00124673405662179f;
    p = p * f + 0.009675536304712296f;
    p = p * f + 0.05548521876335144f;
    p = p * f + 0.24022932350635529f;
    p = p * f + 0.6931470632553101f;
    p = p * f + 1.0f;
    const float scale = f32(((int32_t)n + 127) << 23);
    return d < MIN_EXPONENT ? 0.0f : p * scale;
}

static inline uint32_t fmix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
}

/* Exp(1) noise of (row hash, token): sampling_math.uniform, then neg_log. */
static inline float noise(uint32_t row, uint32_t token) {
    const uint32_t bits = fmix32(row ^ (token * 0x9E3779B9u));
    float u = ((float)(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
    u = u > U_MAX ? U_MAX : u;
    const int32_t ub = bits32(u);
    int32_t exponent = (ub >> 23) - 127;
    float m = f32((ub & 0x7FFFFF) | 0x3F800000);
    const int big = m > SQRT2;
    m = big ? m * 0.5f : m;
    exponent += big;
    const float r = m - 1.0f;
    const float s = r / (r + 2.0f);
    const float z = s * s;
    float p = 0.1111111119389534f;
    p = p * z + 0.1428571492433548f;
    p = p * z + 0.20000000298023224f;
    p = p * z + 0.3333333432674408f;
    const float s2 = s + s;
    const float log_m = s2 + s2 * (z * p);
    return -((float)exponent * LN2 + log_m);
}

/* weights[r, t] = exp_weight(x[r, t] - row_max[r]). */
void exp_weights(const float *x, const float *row_max, float *restrict weights, int64_t rows,
                 int64_t vocab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float m = row_max[r];
        const float *xr = x + r * vocab;
        float *wr = weights + r * vocab;
        for (int64_t t = 0; t < vocab; t++) wr[t] = exp_weight(xr[t] - m);
    }
}

/* out[r] = argmax over the kept tokens t of weights[r, t] / noise(row_hash[r], t), the lowest
 * t among equal scores; a dropped token scores -1 (as Sampler._race's torch.where). `kept`
 * (bytes, 0 or 1) may be NULL: every token. Rows with sampled[r] == 0 are skipped. */
void race(const float *weights, const uint8_t *kept, const uint32_t *row_hash,
          const uint8_t *sampled, int64_t *out, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (!sampled[r]) continue;
        const float *wr = weights + r * vocab;
        const uint8_t *kr = kept ? kept + r * vocab : NULL;
        const uint32_t h = row_hash[r];
        float best = -INFINITY;
        int64_t best_t = 0;
        for (int64_t t = 0; t < vocab; t++) {
            const float score = (kr && !kr[t]) ? -1.0f : wr[t] / noise(h, (uint32_t)t);
            if (score > best) {
                best = score;
                best_t = t;
            }
        }
        out[r] = best_t;
    }
}

#define LANES 16

/* out[r] = torch.argmax(x[r]): the lowest t among equal maxima, and a NaN is larger than any
 * number (the first NaN wins). Each of LANES lanes keeps the first maximum of its own columns
 * (t = lane mod LANES), so the loop vectorises; the lanes' winners are merged at the end.
 * (torch's argmax took 1.7 ms for [64, 32000] on two cores; amax 0.2.) */
void argmax_rows(const float *x, int64_t *out, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * vocab;
        float best[LANES];
        int32_t at[LANES];
        for (int l = 0; l < LANES; l++) {
            best[l] = -INFINITY;
            at[l] = (int32_t)(l < vocab ? l : 0);
        }
        const int64_t body = vocab - vocab % LANES;
        for (int64_t t = 0; t < body; t += LANES) {
#pragma omp simd
            for (int l = 0; l < LANES; l++) {
                const float v = xr[t + l];
                /* larger, or the lane's first NaN (NaN != NaN; a NaN best is kept) */
                const int take = v > best[l] || (v != v && best[l] == best[l]);
                best[l] = take ? v : best[l];
                at[l] = take ? (int32_t)(t + l) : at[l];
            }
        }
        for (int64_t t = body; t < vocab; t++) {  /* the tail, into the lanes it would fill */
            const int l = (int)(t - body);
            const float v = xr[t];
            if (v > best[l] || (v != v && best[l] == best[l])) {
                best[l] = v;
                at[l] = (int32_t)t;
            }
        }
        int w = 0;  /* the winning lane: NaN first, then the larger, then the lower column */
        for (int l = 1; l < LANES; l++) {
            const int nan_l = best[l] != best[l], nan_w = best[w] != best[w];
            const int larger = nan_l ? !nan_w : (!nan_w && best[l] > best[w]);
            const int tie = (nan_l == nan_w) && (nan_l || best[l] == best[w]) && at[l] < at[w];
            if (larger || tie) w = l;
        }
        out[r] = at[w];
    }
}

/* out[r, t] = the race's noise for (row_hash[r], t): sampling_math.exponential_noise, for the
 * tests that compare the two bit for bit. */
void noise_table(const uint32_t *row_hash, float *restrict out, int64_t rows, int64_t vocab) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < vocab; t++) out[r * vocab + t] = noise(row_hash[r], (uint32_t)t);
}
