/* Paged decode attention on the CPU: one query token per row, its keys and values read from the
 * KV cache's pages where they lie (no gather), float32 or bfloat16 cache, float32 arithmetic.
 *
 * Built by engine/layers/native.py, loaded by engine/attention/cpu_kernels.py (gcc -O3 -march=native -fopenmp
 * -ffast-math, linked without -ffast-math so that loading it leaves the process's floating-point
 * mode alone). OpenMP is the runtime torch already loaded (same soname), so the threads are
 * torch's.
 *
 * Layouts (row-major, the engine's):
 *   q        [rows, heads, head_dim], rows q_row_stride elements apart
 *   k, v     [pages, page_size, kv_heads, head_dim], the cache of one layer
 *   tables   [rows, >= pages of the row] int32 page ids, rows table_stride apart
 *   lens     [rows] int32 context length of each row, >= 1 (its query sits at lens - 1)
 *   out      [rows, heads, head_dim], contiguous, the dtype of q
 *   sinks    [heads] float32 or NULL
 * Query head h reads kv head h / (heads / kv_heads), as grouped-query attention does.
 *
 * Each row is one work item: its query heads are scored against every key it sees (K read
 * once), softmax in float32, then the values summed with those weights (V read once).
 *
 * A layer's kind, as transformers' eager attention computes it:
 *   window   > 0: a row sees only its last `window` keys, from max(0, len - window). Pages
 *            wholly before that are never read (the KV cache may point their table entries
 *            at a scratch page once the window has passed them).
 *   softcap  > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2).
 *   sinks    one more logit per head in the softmax's max and denominator, with no value: it
 *            only takes probability mass from the keys (gpt-oss).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../layers/cpu_dtypes.h"

/* element i of a float32 or bfloat16 vector, as float32 (bf16 is float32's upper half) */
static inline const float *as_f32(const void *src, int dtype, float *tmp, int64_t n) {
    if (dtype == F32) return (const float *)src;
    const uint16_t *half = (const uint16_t *)src;
    uint32_t *bits = (uint32_t *)tmp;  /* built with -fno-strict-aliasing */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)half[i] << 16;
    return tmp;
}

static inline void store(void *dst, int dtype, const float *src, float mul, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) put(dst, dtype, i, src[i] * mul);
}

/* Token t's row of the next page into the cache while token t of this one is computed: the
 * pages lie anywhere in the cache, where the hardware prefetchers do not follow. */
static inline void prefetch(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
}

/* Each head's scores [heads, n] -> the softmax's numerators exp(score - max), in place;
 * inv_sum[h] = 1 / their sum (the output is divided by it at the end). A head's sink, when
 * given, joins the max and the sum as one more score (so no key's weight can overflow). */
static inline void softmax_numerators(float *scores, int32_t n, int64_t heads, float softcap,
                                      const float *sinks, float *inv_sum) {
    if (softcap > 0.f) {
        const float inv_cap = 1.f / softcap;
#pragma omp simd
        for (int64_t i = 0; i < heads * n; i++) scores[i] = softcap * tanhf(scores[i] * inv_cap);
    }
    for (int64_t h = 0; h < heads; h++) {
        float *row = scores + h * n, top = sinks ? sinks[h] : row[0], sum = 0.f;
        for (int32_t t = 0; t < n; t++) top = row[t] > top ? row[t] : top;
#pragma omp simd reduction(+ : sum)
        for (int32_t t = 0; t < n; t++) {
            row[t] = expf(row[t] - top);
            sum += row[t];
        }
        if (sinks) sum += expf(sinks[h] - top);
        inv_sum[h] = 1.f / sum;
    }
}

/* What one row's attention needs beyond its query and pages: the layer's kind. */
typedef struct {
    float scale, softcap;  /* softcap 0: none */
    const float *sinks;    /* [heads] or NULL */
} Kind;

/* One row: every query head against every key it sees, keys [first, len) of its context. A
 * token's keys (all kv heads) are one contiguous run of the page, read in order: reading one
 * kv head's keys at the token stride instead left every load waiting on memory (the
 * prefetchers stop at each 4 KiB). Tokens go by page from the one holding `first`, so a page
 * wholly before the window is neither read nor prefetched. */
static inline __attribute__((always_inline)) void attend_row(
    int dtype, const char *q, const char *k_cache, const char *v_cache, const int32_t *table,
    int32_t first, int32_t len, char *out, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t page_size, int64_t page_stride, Kind kind, float *qf, float *scores, float *acc,
    float *tmp) {
    const int64_t esize = dtype == F32 ? 4 : 2, d = head_dim, group = heads / kv_heads;
    const int64_t token_stride = kv_heads * d, token_bytes = token_stride * esize;
    const int64_t page_bytes = page_stride * esize;
    const int32_t n = len - first, first_page = first - first % (int32_t)page_size;
    const float *src = as_f32(q, dtype, tmp, heads * d);
    for (int64_t i = 0; i < heads * d; i++) qf[i] = src[i] * kind.scale;
    /* No division in the loops: tokens by page, query heads by kv head (a div costs 25-40
     * cycles; per token and head they were most of the time). */
    for (int32_t start = first_page; start < len; start += page_size) {  /* scores[head, t] */
        const int32_t p = start / page_size;
        const int32_t end = start + page_size < len ? start + page_size : len;
        const char *page = k_cache + (int64_t)table[p] * page_bytes;
        const char *next = end < len ? k_cache + (int64_t)table[p + 1] * page_bytes : NULL;
        for (int32_t t = start > first ? start : first; t < end; t++) {
            if (next) prefetch(next + (t - start) * token_bytes, token_bytes);
            const float *keys = as_f32(page + (t - start) * token_bytes, dtype, tmp, token_stride);
            for (int64_t h = 0, kv = 0; kv < kv_heads; kv++) {
                for (int64_t j = 0; j < group; j++, h++) {
                    const float *key = keys + kv * d, *query = qf + h * d;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t i = 0; i < d; i++) s += query[i] * key[i];
                    scores[h * n + t - first] = s;
                }
            }
        }
    }
    /* the queries are spent: qf keeps 1 / sums */
    softmax_numerators(scores, n, heads, kind.softcap, kind.sinks, qf);
    memset(acc, 0, (size_t)(heads * d) * sizeof(float));
    for (int32_t start = first_page; start < len; start += page_size) {
        const int32_t p = start / page_size;
        const int32_t end = start + page_size < len ? start + page_size : len;
        const char *page = v_cache + (int64_t)table[p] * page_bytes;
        const char *next = end < len ? v_cache + (int64_t)table[p + 1] * page_bytes : NULL;
        for (int32_t t = start > first ? start : first; t < end; t++) {
            if (next) prefetch(next + (t - start) * token_bytes, token_bytes);
            const float *values =
                as_f32(page + (t - start) * token_bytes, dtype, tmp, token_stride);
            for (int64_t h = 0, kv = 0; kv < kv_heads; kv++) {
                for (int64_t j = 0; j < group; j++, h++) {
                    const float w = scores[h * n + t - first], *value = values + kv * d;
                    float *a = acc + h * d;
#pragma omp simd
                    for (int64_t i = 0; i < d; i++) a[i] += w * value[i];
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) store(out + h * d * esize, dtype, acc + h * d, qf[h], d);
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512BF16 1

static inline __m512 widen16(const uint16_t *p) { /* 16 bfloat16 -> 16 float32 */
    const __m256i half = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* attend_row for a bfloat16 cache on a CPU with AVX512-BF16 (head_dim a multiple of 32): each
 * query-key product is head_dim / 32 vdpbf16ps on the query and key as they are (bf16 pairs
 * multiplied exactly, summed in float32), scaled after; the values widen in registers. No
 * float32 copy of a key or value: the generic loop spent about a third of its time on them
 * (the kernel is otherwise bound by reading the pages). */
static inline __attribute__((always_inline)) void attend_row_bf16(
    const uint16_t *q, const char *k_cache, const char *v_cache, const int32_t *table,
    int32_t first, int32_t len, uint16_t *out, int64_t heads, int64_t kv_heads, int64_t d,
    int64_t page_size, int64_t page_stride, Kind kind, float *inv_sum, float *scores, float *acc) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * d;
    const int64_t page_bytes = page_stride * 2, token_bytes = token_stride * 2;
    const int32_t n = len - first, first_page = first - first % (int32_t)page_size;
    for (int32_t start = first_page; start < len; start += page_size) {  /* scores[head, t] */
        const int32_t p = start / page_size;
        const int32_t end = start + page_size < len ? start + page_size : len;
        const int32_t t0 = start > first ? start : first;
        const uint16_t *keys = (const uint16_t *)(k_cache + table[p] * page_bytes);
        const char *next = end < len ? k_cache + table[p + 1] * page_bytes : NULL;
        keys += (t0 - start) * token_stride;
        for (int32_t t = t0; t < end; t++, keys += token_stride) {
            if (next) prefetch(next + (t - start) * token_bytes, token_bytes);
            for (int64_t h = 0, kv = 0; kv < kv_heads; kv++) {
                const uint16_t *key = keys + kv * d;
                for (int64_t j = 0; j < group; j++, h++) {
                    const uint16_t *query = q + h * d;
                    __m512 dot = _mm512_setzero_ps();
                    for (int64_t i = 0; i < d; i += 32)
                        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(query + i),
                                               (__m512bh)_mm512_loadu_si512(key + i));
                    scores[h * n + t - first] = _mm512_reduce_add_ps(dot) * kind.scale;
                }
            }
        }
    }
    softmax_numerators(scores, n, heads, kind.softcap, kind.sinks, inv_sum);
    memset(acc, 0, (size_t)(heads * d) * sizeof(float));
    for (int32_t start = first_page; start < len; start += page_size) {
        const int32_t p = start / page_size;
        const int32_t end = start + page_size < len ? start + page_size : len;
        const int32_t t0 = start > first ? start : first;
        const uint16_t *values = (const uint16_t *)(v_cache + table[p] * page_bytes);
        const char *next = end < len ? v_cache + table[p + 1] * page_bytes : NULL;
        values += (t0 - start) * token_stride;
        for (int32_t t = t0; t < end; t++, values += token_stride) {
            if (next) prefetch(next + (t - start) * token_bytes, token_bytes);
            for (int64_t kv = 0; kv < kv_heads; kv++) {
                for (int64_t i = 0; i < d; i += 16) {
                    const __m512 v = widen16(values + kv * d + i);
                    for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
                        float *a = acc + h * d + i;
                        const __m512 w = _mm512_set1_ps(scores[h * n + t - first]);
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(w, v, _mm512_loadu_ps(a)));
                    }
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) store(out + h * d, BF16, acc + h * d, inv_sum[h], d);
}
#else
#define HAVE_AVX512BF16 0
#endif

/* The first key a row sees: its last `window` keys (window > 0), else all of them. */
static inline int32_t first_key(int32_t len, int32_t window) {
    return window > 0 && len > window ? len - window : 0;
}

int paged_decode_attention(int dtype, const void *q, int64_t q_row_stride, const void *k_cache,
                           const void *v_cache, const int32_t *tables, int64_t table_stride,
                           const int32_t *lens, void *out, int64_t rows, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t page_size,
                           int64_t page_stride, float scale, int32_t window, float softcap,
                           const float *sinks, int threads) {
    const int64_t esize = dtype == F32 ? 4 : 2, d = head_dim;
    const Kind kind = {scale, softcap, sinks};
    int32_t max_keys = 1; /* the most keys a row sees: the scores buffer's width */
    for (int64_t r = 0; r < rows; r++) {
        const int32_t n = lens[r] - first_key(lens[r], window);
        max_keys = n > max_keys ? n : max_keys;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* per thread: scaled queries, scores, accumulators, a conversion buffer */
        const int64_t qd = heads * d, width = (heads > kv_heads ? heads : kv_heads) * d;
        float *work = malloc(sizeof(float) * (size_t)(2 * qd + heads * (int64_t)max_keys + width));
        if (work == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (work == NULL) continue;
            const char *qr = (const char *)q + r * q_row_stride * esize;
            char *o = (char *)out + r * qd * esize;
            float *scores = work + qd, *acc = scores + heads * max_keys, *tmp = acc + qd;
            const int32_t len = lens[r], first = first_key(len, window);
/* A constant dtype and head_dim let the compiler unroll and vectorise the inner loops
 * (1.2-1.3x at head_dim 64); other head sizes run the same loops, generic. */
#define ATTEND_BF16(D)                                                                       \
    attend_row_bf16((const uint16_t *)qr, k_cache, v_cache, tables + r * table_stride, first, \
                    len, (uint16_t *)o, heads, kv_heads, D, page_size, page_stride, kind, work,  \
                    scores, acc)
#define ATTEND(DTYPE, D)                                                                     \
    attend_row(DTYPE, qr, k_cache, v_cache, tables + r * table_stride, first, len, o, heads, \
               kv_heads, D, page_size, page_stride, kind, work, scores, acc, tmp)
#if HAVE_AVX512BF16
            if (dtype == BF16 && d % 32 == 0) {
                if (d == 64) ATTEND_BF16(64);
                else ATTEND_BF16(d);
                continue;
            }
#endif
            if (dtype == F32 && d == 64) ATTEND(F32, 64);
            else if (dtype == F32 && d == 128) ATTEND(F32, 128);
            else if (dtype == F32) ATTEND(F32, d);
            else if (d == 64) ATTEND(BF16, 64);
            else if (d == 128) ATTEND(BF16, 128);
            else ATTEND(BF16, d);
#undef ATTEND
#undef ATTEND_BF16
        }
        free(work);
    }
    return failed ? -1 : 0;
}

/* Rotary embedding of q and k at each token's position, then k and v into the cache at the
 * token's slot: torch_ref's rotary (engine/layers/rope.py) and two index_copy_ calls, in one
 * pass. The cos/sin tables are float32 [positions, rotary_dim] and, as transformers does, cast
 * to the tensors' dtype first; x * cos and rotate_half(x) * sin are each rounded to the dtype,
 * then their sum. The first r = rotary_dim dimensions of each head rotate (rotate_half within
 * them); a partial rotary's other d - r pass through unchanged.
 *   q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim]: rows *_row_stride
 *   elements apart, heads contiguous; q_out, k_out contiguous; slots int64 cache slots
 *   (page * page_size + offset) in caches of [slots, kv_heads, head_dim]. */
static inline __attribute__((always_inline)) void rotate_heads(
    int dtype, const char *x, int64_t n_heads, int64_t d, int64_t r, const float *cos,
    const float *sin, char *out, char *cache_row) {
    const int64_t half = r / 2, esize = dtype == F32 ? 4 : 2;
    for (int64_t h = 0; h < n_heads; h++) {
        const char *xh = x + h * d * esize;
        char *oh = out + h * d * esize;
#pragma omp simd
        for (int64_t i = 0; i < r; i++) {
            const float rot = i < half ? -load(xh, dtype, i + half) : load(xh, dtype, i - half);
            const float a = round_to(dtype, load(xh, dtype, i) * round_to(dtype, cos[i]));
            const float b = round_to(dtype, rot * round_to(dtype, sin[i]));
            put(oh, dtype, i, a + b);
        }
        if (r < d) memcpy(oh + r * esize, xh + r * esize, (size_t)((d - r) * esize));
        if (cache_row) memcpy(cache_row + h * d * esize, oh, (size_t)(d * esize));
    }
}

/* One token t: q and k rotated, k and v into the cache at the token's slot. */
static inline __attribute__((always_inline)) void rotary_store_token(
    int dtype, const char *q, int64_t q_stride, const char *k, int64_t k_stride, const char *v,
    int64_t v_stride, const int64_t *positions, const float *cos, const float *sin, char *q_out,
    char *k_out, char *k_cache, char *v_cache, const int64_t *slots, int64_t t, int64_t heads,
    int64_t kv_heads, int64_t d, int64_t r) {
    const int64_t esize = dtype == F32 ? 4 : 2, kv_row = kv_heads * d * esize;
    const float *c = cos + positions[t] * r, *s = sin + positions[t] * r;
    rotate_heads(dtype, q + t * q_stride * esize, heads, d, r, c, s,
                 q_out + t * heads * d * esize, NULL);
    rotate_heads(dtype, k + t * k_stride * esize, kv_heads, d, r, c, s, k_out + t * kv_row,
                 k_cache + slots[t] * kv_row);
    memcpy(v_cache + slots[t] * kv_row, v + t * v_stride * esize, (size_t)kv_row);
}

/* NOTE: the dtype and head_dim reach each token as literals from inside the parallel loop:
 * GCC outlines an OpenMP region before it inlines, so a region inside an always_inline
 * function would see them as variables (engine/layers/cpu_ops.c's rms_norm says more). */
void rotary_store(int dtype, const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                  const void *v, int64_t v_stride, const int64_t *positions, const float *cos,
                  const float *sin, void *q_out, void *k_out, void *k_cache, void *v_cache,
                  const int64_t *slots, int64_t tokens, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t rotary_dim, int threads) {
#define ROTATE(DTYPE, D, R)                                                                  \
    rotary_store_token(DTYPE, q, q_stride, k, k_stride, v, v_stride, positions, cos, sin,    \
                       q_out, k_out, k_cache, v_cache, slots, t, heads, kv_heads, D, R)
    const int whole = rotary_dim == head_dim;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        if (dtype == F32 && whole && head_dim == 64) ROTATE(F32, 64, 64);
        else if (dtype == F32 && whole && head_dim == 128) ROTATE(F32, 128, 128);
        else if (dtype == F32) ROTATE(F32, head_dim, rotary_dim);
        else if (whole && head_dim == 64) ROTATE(BF16, 64, 64);
        else if (whole && head_dim == 128) ROTATE(BF16, 128, 128);
        else ROTATE(BF16, head_dim, rotary_dim);
    }
#undef ROTATE
}
