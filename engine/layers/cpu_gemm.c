/* y = x W^T (+ bias) in bfloat16 on Intel AMX, for the few rows of a decode step.
 *
 * A decode step's linear layers are bound by reading their weights: a step has 1-100 rows,
 * and each weight is read from memory once per step. On a 2-core AMX Xeon, oneDNN's bfloat16
 * GEMM on its packed weights read llama-75m's 150 MB in 7.6-9.3 ms at 1-32 rows and 11.4 ms at
 * 64; this kernel in 5.9-7.2 and 9.5 ms (bench/cpu/linear.py, docs/benchmarks.md;
 * engine/layers/cpu_gemm.py says where it runs).
 *
 * Layouts. x: [M, K] bfloat16, rows `x_stride` elements apart. The weight is packed once
 * (cpu_gemm.py's `pack`) into AMX's pair-interleaved tiles, zero-padded to whole tiles:
 * wp[NB][KC][16 k pairs][16 columns][2], NB = N / 16 rounded up to even, KC = K / 32 rounded up;
 * one [KC] run is one 16-column block's whole K, read front to back. y: [M, N] bfloat16, or
 * float32 (`out_f32`: the same bfloat16 values, widened, as logits are), rows `y_stride`
 * elements apart.
 *
 * Tiles: 2 x 2 blocking. Per 32 columns (two blocks, split over the threads) and 32 rows, the
 * four float32 accumulators are tiles 0-3, the rows' 32 K values tiles 4-5 and the two
 * blocks' weights tiles 6-7: each tile loaded is used twice (a last 16 rows run alone,
 * 1 x 2). x is first copied into a zero-padded buffer of whole tiles (16 rows, 32 K values),
 * so no tile reads past it.
 * Rounding: float32 sums of bfloat16 products, the bias added in float32, then one rounding
 * to bfloat16 (to nearest even): what a bfloat16 GEMM with float32 accumulation computes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: a process asks once to use AMX's tile state */
#define XFEATURE_XTILEDATA 18

/* 1 when this process may run AMX instructions (asks the kernel; idempotent), else 0. */
int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void configure_tiles(void) { /* eight tiles of 16 rows x 64 bytes */
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Rows [m0, m_end) of one 16-column block from its float32 tile `acc` (row r at acc[r]):
 * bias added, rounded to bfloat16, stored as bfloat16 or (`out_f32`) as float32, only the
 * block's `cols` real columns. */
static void store_block(const float (*acc)[16], int64_t m0, int64_t m_end, int64_t n0,
                        int64_t cols, const uint16_t *bias, void *y, int64_t y_stride,
                        int out_f32) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n0));
        b = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    for (int64_t m = m0; m < m_end; m++) {
        const __m512 sum = _mm512_add_ps(_mm512_load_ps(acc[m - m0]), b);
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sum);
        if (out_f32) {
            const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16);
            float *row = (float *)y + m * y_stride + n0;
            _mm512_mask_storeu_ps(row, keep, _mm512_castsi512_ps(wide));
        } else {
            _mm256_mask_storeu_epi16((uint16_t *)y + m * y_stride + n0, keep, rounded);
        }
    }
}

void amx_linear(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, const uint16_t *wp,
                int64_t N, const uint16_t *bias, void *y, int64_t y_stride, int out_f32,
                int threads) {
    const int64_t KC = (K + 31) / 32, NB = (N + 31) / 32 * 2, MP = (M + 15) / 16 * 16;
    const int64_t kpad = KC * 32; /* x's padded row length, elements */
    uint16_t *xp = aligned_alloc(64, (size_t)(MP * kpad * 2));
    if (xp == NULL) abort();
    for (int64_t m = 0; m < MP; m++) {
        uint16_t *row = xp + m * kpad;
        const int64_t real = m < M ? K : 0;
        if (real) memcpy(row, x + m * x_stride, (size_t)K * 2);
        memset(row + real, 0, (size_t)(kpad - real) * 2);
    }
#pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        float acc[4][16][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < NB; nb += 2) {
            const uint16_t *w0 = wp + nb * KC * 512, *w1 = w0 + KC * 512;
            for (int64_t m0 = 0; m0 < MP; m0 += 32) {
                const uint16_t *a = xp + m0 * kpad;
                const int pair = m0 + 16 < MP; /* else one row tile: tiles 1, 3 and 5 idle */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kc = 0; kc < KC; kc++) {
                    _tile_loadd(4, a + kc * 32, kpad * 2);
                    _tile_loadd(6, w0 + kc * 512, 64);
                    _tile_loadd(7, w1 + kc * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(2, 4, 7);
                    if (pair) {
                        _tile_loadd(5, a + 16 * kpad + kc * 32, kpad * 2);
                        _tile_dpbf16ps(1, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, acc[0], 64);
                _tile_stored(1, acc[1], 64);
                _tile_stored(2, acc[2], 64);
                _tile_stored(3, acc[3], 64);
                for (int j = 0; j < 2; j++) { /* the two column blocks, each two row tiles */
                    const int64_t n0 = (nb + j) * 16;
                    const int64_t cols = N - n0 < 16 ? N - n0 : 16;
                    for (int i = 0; i < 2 && cols > 0; i++) {
                        const int64_t first = m0 + 16 * i, end = first + 16 < M ? first + 16 : M;
                        if (first < end)
                            store_block((const float(*)[16])acc[2 * j + i], first, end, n0,
                                        cols, bias, y, y_stride, out_f32);
                    }
                }
            }
        }
        _tile_release();
    }
    free(xp);
}

#else
int amx_enable(void) { return 0; } /* built for a CPU without AMX: callers keep oneDNN */

void amx_linear(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, const uint16_t *wp,
                int64_t N, const uint16_t *bias, void *y, int64_t y_stride, int out_f32,
                int threads) {
    abort(); /* unreachable: amx_enable() said no */
}
#endif
