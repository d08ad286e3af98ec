/* y = x @ W^T (+ bias) with bfloat16 weights, on CPUs without bf16 instructions.
 *
 * On CPUs without bf16 matmul instructions (AVX2-only) torch's bf16 GEMM is emulated and slow,
 * and oneDNN cannot pack bf16 weights; an fp32 packed copy runs at about half this machine
 * kind's FMA peak for decode-sized batches and is twice the bytes to read. This kernel reads
 * the bf16 weights themselves, widens them to fp32 in registers and accumulates in fp32, as a
 * bf16 GEMM does.
 *
 * Weight layout (made once at load by kernels/cpu_linear.py, `pack_panels`): panels of 16
 * output columns, [ceil(N/16)][K][16] bf16, the last panel zero-padded. Within the 16 values
 * of one k, position 2j holds column j and 2j+1 column j+8, so one 32-byte load widens to two
 * fp32 vectors with a shift (columns 0..7) and a mask (columns 8..15), both in column order.
 *
 * x (bf16, [M, K] rows with a row stride) is widened to fp32 once per call. A register tile of
 * up to 6 rows x 16 columns keeps 12 accumulators (AVX2; with AVX-512F, up to 12 rows of one 16-lane
 * accumulator each, the panel's k widened by one load, in stored order, put in column order at the
 * end: half the FMA instructions for the same sums, added in the same order, so both paths give the
 * same bits); each panel is multiplied by every row tile
 * in turn while it sits in L2, so the weights stream from memory once per block of rows.
 * Threads split the panels. The bias (fp32, padded to whole panels, may be NULL) is added in
 * fp32 and the result rounded to nearest even bf16. Needs K % 8 == 0 (kernels/cpu_linear.py
 * checks). Built at first use by common/native_build.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#if defined(__AVX512F__)
#define PD_AVX512 1
#endif
#endif

#define PANEL 16          /* output columns per weight panel */
#ifdef PD_AVX512
#define TILE_ROWS 12      /* activation rows per register tile: one 16-lane accumulator each */
#else
#define TILE_ROWS 6       /* activation rows per register tile: two 8-lane accumulators each */
#endif
#ifndef ROW_BLOCK_BYTES
#define ROW_BLOCK_BYTES (256 << 10) /* fp32 x rows multiplied by one panel before the next (they stay in L2) */
#endif
#define SERIAL_WORK 4096  /* M x N x K / 64 below which one thread does it all */

#include "bf16.h"

/* Stored position of column c (0..15) within one k of a panel. */
static inline int panel_pos(int c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }

/* Rows [m, m + mb) of y, columns [n, n + nc): acc (mb x 16 fp32, column order) + bias, rounded. */
static void store_tile(uint16_t *y, int64_t y_stride, const float *acc, const float *bias, int m, int mb, int n,
                       int nc) {
    for (int i = 0; i < mb; i++) {
        uint16_t *yr = y + (size_t)(m + i) * y_stride + n;
        for (int c = 0; c < nc; c++) yr[c] = f32_to_bf16(acc[i * PANEL + c] + (bias ? bias[n + c] : 0.f));
    }
}

#ifdef PD_AVX2
/* Lanes of v rounded to nearest even bf16, in the low 16 bits of each 32-bit lane. */
static inline __m256i round_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i bump = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bump), 16);
    const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* MB rows x 16 columns of fp32 (acc, row stride 16, column order) + bias, rounded and stored to y;
 * a partial last panel goes through the scalar path. */
static inline void store_rows(uint16_t *y, int64_t y_stride, const float *acc, int mb, const float *bias, int m,
                              int n, int nc) {
    if (nc != PANEL) {
        store_tile(y, y_stride, acc, bias, m, mb, n, nc);
        return;
    }
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + n + 8) : _mm256_setzero_ps();
    for (int i = 0; i < mb; i++) {
        const __m256i r0 = round_bf16(_mm256_add_ps(_mm256_loadu_ps(acc + i * PANEL), b0));
        const __m256i r1 = round_bf16(_mm256_add_ps(_mm256_loadu_ps(acc + i * PANEL + 8), b1));
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xd8);
        _mm256_storeu_si256((__m256i *)(y + (size_t)(m + i) * y_stride + n), packed);
    }
}

#ifdef PD_AVX512
/* MB rows of x (fp32, row stride K) times one panel with AVX-512F: MB 16-lane accumulators in named
 * variables, lanes in the panel's stored order (2j: column j, 2j+1: column j + 8) until the end. */
#define Z_ZERO(i) __m512 z##i = _mm512_setzero_ps();
#define Z_FMA(i) \
    if (MB > i) z##i = _mm512_fmadd_ps(_mm512_set1_ps(x##i[k + kk]), w, z##i);
#define Z_STORE(i) \
    if (MB > i) _mm512_storeu_ps(out + i * PANEL, _mm512_permutexvar_ps(order, z##i));
static inline __attribute__((always_inline)) void tile(int MB, const float *x, int K, const uint16_t *panel,
                                                       const uint16_t *next, uint16_t *y, int64_t y_stride,
                                                       const float *bias, int m, int n, int nc) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * (size_t)K, *x3 = x + 3 * (size_t)K, *x4 = x + 4 * (size_t)K,
                *x5 = x + 5 * (size_t)K, *x6 = x + 6 * (size_t)K, *x7 = x + 7 * (size_t)K, *x8 = x + 8 * (size_t)K,
                *x9 = x + 9 * (size_t)K, *x10 = x + 10 * (size_t)K, *x11 = x + 11 * (size_t)K;
    Z_ZERO(0) Z_ZERO(1) Z_ZERO(2) Z_ZERO(3) Z_ZERO(4) Z_ZERO(5) Z_ZERO(6) Z_ZERO(7) Z_ZERO(8) Z_ZERO(9) Z_ZERO(10)
    Z_ZERO(11)
    for (int k = 0; k < K; k += 2) {
        _mm_prefetch((const char *)(next + (size_t)k * PANEL), _MM_HINT_T1);
        for (int kk = 0; kk < 2; kk++) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(panel + (size_t)(k + kk) * PANEL));
            const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            Z_FMA(0) Z_FMA(1) Z_FMA(2) Z_FMA(3) Z_FMA(4) Z_FMA(5) Z_FMA(6) Z_FMA(7) Z_FMA(8) Z_FMA(9) Z_FMA(10)
            Z_FMA(11)
        }
    }
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    float out[TILE_ROWS * PANEL];
    Z_STORE(0) Z_STORE(1) Z_STORE(2) Z_STORE(3) Z_STORE(4) Z_STORE(5) Z_STORE(6) Z_STORE(7) Z_STORE(8) Z_STORE(9)
    Z_STORE(10) Z_STORE(11)
    store_rows(y, y_stride, out, MB, bias, m, n, nc);
}
#else
/* MB rows of x (fp32, row stride K) times one panel: the register tile, 2 x MB accumulators held in
 * named variables (an array of them gets spilled). `next` is the panel to prefetch meanwhile (the
 * next one this thread works on). */
#define ACC_ZERO(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();
#define ACC_FMA(i)                                                                                \
    if (MB > i) {                                                                                 \
        const __m256 xb = _mm256_broadcast_ss(x##i + k + kk);                                     \
        a##i##0 = _mm256_fmadd_ps(xb, w0, a##i##0);                                               \
        a##i##1 = _mm256_fmadd_ps(xb, w1, a##i##1);                                               \
    }
#define ACC_STORE(i)                                                                              \
    if (MB > i) {                                                                                 \
        _mm256_storeu_ps(out + i * PANEL, a##i##0);                                               \
        _mm256_storeu_ps(out + i * PANEL + 8, a##i##1);                                           \
    }
static inline __attribute__((always_inline)) void tile(int MB, const float *x, int K, const uint16_t *panel,
                                                       const uint16_t *next, uint16_t *y, int64_t y_stride,
                                                       const float *bias, int m, int n, int nc) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * (size_t)K, *x3 = x + 3 * (size_t)K, *x4 = x + 4 * (size_t)K,
                *x5 = x + 5 * (size_t)K;
    ACC_ZERO(0) ACC_ZERO(1) ACC_ZERO(2) ACC_ZERO(3) ACC_ZERO(4) ACC_ZERO(5)
    const __m256i mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int k = 0; k < K; k += 2) {
        _mm_prefetch((const char *)(next + (size_t)k * PANEL), _MM_HINT_T1);
        for (int kk = 0; kk < 2; kk++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(panel + (size_t)(k + kk) * PANEL));
            const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(w, mask));
            ACC_FMA(0) ACC_FMA(1) ACC_FMA(2) ACC_FMA(3) ACC_FMA(4) ACC_FMA(5)
        }
    }
    float out[TILE_ROWS * PANEL];
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5)
    store_rows(y, y_stride, out, MB, bias, m, n, nc);
}
#endif

#define DEFINE_TILE(MB)                                                                                       \
    static void tile_##MB(const float *x, int K, const uint16_t *panel, const uint16_t *next, uint16_t *y,    \
                          int64_t y_stride, const float *bias, int m, int n, int nc) {                        \
        tile(MB, x, K, panel, next, y, y_stride, bias, m, n, nc);                                              \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

typedef void (*tile_fn)(const float *, int, const uint16_t *, const uint16_t *, uint16_t *, int64_t, const float *,
                        int, int, int);
#ifdef PD_AVX512
DEFINE_TILE(7)
DEFINE_TILE(8)
DEFINE_TILE(9)
DEFINE_TILE(10)
DEFINE_TILE(11)
DEFINE_TILE(12)
static const tile_fn TILES[TILE_ROWS + 1] = {NULL,   tile_1, tile_2, tile_3,  tile_4,  tile_5, tile_6,
                                             tile_7, tile_8, tile_9, tile_10, tile_11, tile_12};
#else
static const tile_fn TILES[TILE_ROWS + 1] = {NULL, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
#endif
#endif

/* Rows [m0, m1) of x (fp32, row stride K) times panel p. */
static void panel_rows(const float *xf, const uint16_t *wp, const uint16_t *next, const float *bias, uint16_t *y,
                       int64_t y_stride, int m0, int m1, int p, int N, int K) {
    const uint16_t *panel = wp + (size_t)p * K * PANEL;
    const int n = p * PANEL, nc = N - n < PANEL ? N - n : PANEL;
    for (int m = m0; m < m1; m += TILE_ROWS) {
        const int mb = m1 - m < TILE_ROWS ? m1 - m : TILE_ROWS;
#ifdef PD_AVX2
        TILES[mb](xf + (size_t)m * K, K, panel, next, y, y_stride, bias, m, n, nc);
#else
        float acc[TILE_ROWS * PANEL];
        for (int i = 0; i < mb; i++)
            for (int c = 0; c < PANEL; c++) {
                float s = 0.f;
                for (int k = 0; k < K; k++)
                    s += xf[(size_t)(m + i) * K + k] * bf16_to_f32(panel[(size_t)k * PANEL + panel_pos(c)]);
                acc[i * PANEL + c] = s;
            }
        store_tile(y, y_stride, acc, bias, m, mb, n, nc);
        (void)next;
#endif
    }
}

/* y[M, N] (bf16, row stride y_stride) = x[M, K] (bf16, row stride x_stride) @ W^T (+ bias), W given
 * as panels (see the header). bias: fp32, ceil(N/16)*16 values, or NULL. Returns 0, or -1 when
 * the scratch for x could not be allocated or the arguments are out of range. */
int pd_linear_bf16(void *y, const void *x, const void *w_panels, const float *bias, int M, int N, int K,
                   int64_t x_stride, int64_t y_stride, int num_threads) {
    if (M < 1 || N < 1 || K < 8 || K % 8 != 0) return -1;
    float *xf = malloc(sizeof(float) * (size_t)M * K);
    if (xf == NULL) return -1;
    const uint16_t *xs = (const uint16_t *)x, *wp = (const uint16_t *)w_panels;
    uint16_t *ys = (uint16_t *)y;
    const int panels = (N + PANEL - 1) / PANEL;
    const int64_t work = (int64_t)M * N * K / 64;
    const int threads = work < SERIAL_WORK ? 1 : num_threads;
    /* Blocks of rows whose fp32 x fits ROW_BLOCK_BYTES, evened out, whole register tiles where possible. */
    int max_rows = (int)(ROW_BLOCK_BYTES / ((size_t)K * sizeof(float)));
    max_rows = max_rows < TILE_ROWS ? TILE_ROWS : max_rows / TILE_ROWS * TILE_ROWS;
    const int blocks = (M + max_rows - 1) / max_rows;
    const int row_block = ((M + blocks - 1) / blocks + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            const uint16_t *src = xs + (size_t)m * x_stride;
            float *dst = xf + (size_t)m * K;
            for (int k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
        }
        /* Each thread takes a contiguous run of panels (the implicit barrier above publishes xf). */
        int nt = 1, t = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int m0 = 0; m0 < M; m0 += row_block) {
            const int m1 = M - m0 < row_block ? M : m0 + row_block;
            for (int p = p0; p < p1; p++) {
                const uint16_t *next = wp + (size_t)(p + 1 < p1 ? p + 1 : p) * K * PANEL;
                panel_rows(xf, wp, next, bias, ys, y_stride, m0, m1, p, N, K);
            }
        }
    }
    free(xf);
    return 0;
}
