/* y = x @ W^T (+ bias) with bfloat16 weights and activations, for decode-sized batches on CPUs with
 * AVX512_BF16 (Zen 4, Cooper Lake and later) and without AMX.
 *
 * Why: oneDNN's packed bf16 GEMM on such a CPU runs decode batches (1..64 rows) well below the
 * dot-product peak while the weights stream from memory every step (benchmarks/linear_kernels.py).
 * This kernel keeps the `vdpbf16ps` pipe busy: a register tile of up to 16 rows x 16..64 columns,
 * every weight load feeding R dot instructions, and a software prefetch of the weight stream ahead.
 *
 * Weight layout (made once at load by kernels/cpu_linear.py, `Bf16DotLinear.pack`): panels of 16
 * output columns, [ceil(N/16)][K/2][16][2] bf16, the last panel zero-padded: one k pair of 16
 * columns is one 64-byte line, the operand of one `vdpbf16ps`. x (bf16 [M, K], row stride
 * x_stride) is repacked per call, per block of rows, to [K/2][rows] 32-bit pairs, so a row tile's
 * pairs for one k pair are adjacent; each is broadcast to all 16 lanes.
 *
 * Numerics: a bf16 x bf16 product is exact in fp32; `vdpbf16ps` adds the two products of a pair
 * to the fp32 accumulator, rounding to nearest even (fp32 accumulation, in another order than a
 * plain loop or oneDNN). It ignores MXCSR: denormal inputs are
 * read as zero and denormal results are flushed to zero. oneDNN's bf16 kernels on these CPUs use
 * the same instruction, so they flush alike (tests/kernels/test_cpu_linear.py checks both). The bias
 * (fp32, padded to whole panels, may be NULL) is added in fp32 and y rounded to nearest even bf16
 * in integer arithmetic, as torch rounds (denormals kept, NaN stays NaN).
 *
 * Threads split the panels. Needs K % 2 == 0. Compiled without AVX512_BF16 (an AVX2-only CPU), the
 * entry point returns -2 and the engine keeps oneDNN / kernels/csrc/cpu_linear_bf16.c.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(PD_NO_AVX512BF16)
#include <immintrin.h>
#define PD_DOT 1
#endif

#define PANEL 16          /* output columns per weight panel (one zmm of fp32 accumulators) */
#define MAX_ROWS 16       /* activation rows per register tile */
#ifndef PREFETCH_LINES
#define PREFETCH_LINES 64 /* weight lines (k pairs of one panel) prefetched ahead into L2 */
#endif
#ifndef PREFETCH_NEAR
#define PREFETCH_NEAR 8   /* ... and from there into L1 */
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
#ifndef PREFETCH_MIN_ROWS
#define PREFETCH_MIN_ROWS 4 /* fewer rows per tile: the hardware prefetcher alone streams faster */
#endif
#ifndef ROW_BLOCK_BYTES
#define ROW_BLOCK_BYTES (256 << 10) /* x pairs of one block of rows (they stay in L2) */
#endif
#define SERIAL_WORK 4096  /* M x N x K / 64 below which one thread does it all */

int pd_linear_bf16_dot_available(void) {
#ifdef PD_DOT
    return 1;
#else
    return 0;
#endif
}

#ifdef PD_DOT
/* Lanes of v rounded to nearest even bf16 (NaN kept quiet), as torch rounds. */
static inline __m256i round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bump = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bump), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* One register tile: R rows (rows m.. of y) x C panels (from panel p) over the whole of K.
 * xr: the tile's first row in its block of x pairs [K/2][ld]; wp: panels; acc[R][C] stay in
 * registers once R and C are constants. */
static inline __attribute__((always_inline)) void tile(const int R, const int C, const uint32_t *xr, int ld,
                                                       const uint16_t *wp, int K, int p, int m, int N,
                                                       const float *bias, uint16_t *y, int64_t y_stride) {
    const int KP = K / 2;
    const uint16_t *w[4];
    __m512 acc[MAX_ROWS][4];
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) w[c] = wp + (size_t)(p + c) * KP * 2 * PANEL;
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int kp = 0; kp < KP; kp++) {
        __m512bh wv[4];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            if (R >= PREFETCH_MIN_ROWS) { /* past the panel's end: the next panel, or nothing (no fault) */
                _mm_prefetch((const char *)(w[c] + (size_t)(kp + PREFETCH_LINES) * 2 * PANEL), PREFETCH_HINT);
                _mm_prefetch((const char *)(w[c] + (size_t)(kp + PREFETCH_NEAR) * 2 * PANEL), _MM_HINT_T0);
            }
            wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(w[c] + (size_t)kp * 2 * PANEL));
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[(size_t)kp * ld + r]);
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
        const int n = (p + c) * PANEL, nc = N - n < PANEL ? N - n : PANEL;
        const __mmask16 keep = (__mmask16)((1u << nc) - 1u);
        const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            _mm256_mask_storeu_epi16(y + (size_t)(m + r) * y_stride + n, keep,
                                     round_bf16(_mm512_add_ps(acc[r][c], b)));
    }
}

/* Columns per tile (in panels) for a tile of R rows: enough accumulators to cover the dot
 * instruction's latency, at most 24 of the 32 vector registers (the rest hold weights). */
#define COLS_FOR(R) ((R) <= 5 ? 4 : (R) <= 8 ? 3 : (R) <= 12 ? 2 : 1)

typedef void (*tile_fn)(const uint32_t *, int, const uint16_t *, int, int, int, int, const float *, uint16_t *,
                        int64_t);
#define DEFINE_TILE(R, C)                                                                                      \
    static void tile_##R##x##C(const uint32_t *xr, int ld, const uint16_t *wp, int K, int p, int m, int N,     \
                               const float *bias, uint16_t *y, int64_t ys) {                                   \
        tile(R, C, xr, ld, wp, K, p, m, N, bias, y, ys);                                                       \
    }
#define DEFINE_TILES(R) DEFINE_TILE(R, 1) DEFINE_TILE(R, 2) DEFINE_TILE(R, 3) DEFINE_TILE(R, 4)
DEFINE_TILES(1) DEFINE_TILES(2) DEFINE_TILES(3) DEFINE_TILES(4) DEFINE_TILES(5) DEFINE_TILES(6) DEFINE_TILES(7)
DEFINE_TILES(8) DEFINE_TILES(9) DEFINE_TILES(10) DEFINE_TILES(11) DEFINE_TILES(12) DEFINE_TILES(13)
DEFINE_TILES(14) DEFINE_TILES(15) DEFINE_TILES(16)
#define T(R) {tile_##R##x1, tile_##R##x2, tile_##R##x3, tile_##R##x4}
static const tile_fn TILES[MAX_ROWS + 1][4] = {{NULL}, T(1),  T(2),  T(3),  T(4),  T(5),  T(6),  T(7), T(8),
                                               T(9),   T(10), T(11), T(12), T(13), T(14), T(15), T(16)};
#undef T

/* Panels [p0, p1) times one block of rows (y rows m0..m0+ld, x pairs xb [K/2][ld]): groups of
 * COLS_FOR(rows) panels, each multiplied by every row tile while it is in L1/L2, so the weights
 * stream from memory once per block. Row tiles are evened out (17 rows: 9 + 8, not 16 + 1), all
 * of them as wide as the tallest allows. */
static void block_panels(const uint32_t *xb, int ld, int m0, const uint16_t *wp, int K, int N, int p0, int p1,
                         const float *bias, uint16_t *y, int64_t y_stride) {
    const int tiles = (ld + MAX_ROWS - 1) / MAX_ROWS, rows = (ld + tiles - 1) / tiles;
    int p = p0;
    while (p < p1) {
        const int cols = p1 - p < COLS_FOR(rows) ? 1 : COLS_FOR(rows);
        for (int t = 0; t < tiles; t++) {
            const int i0 = (int)((int64_t)ld * t / tiles), i1 = (int)((int64_t)ld * (t + 1) / tiles);
            TILES[i1 - i0][cols - 1](xb + i0, ld, wp, K, p, m0 + i0, N, bias, y, y_stride);
        }
        p += cols;
    }
}
#endif

/* y[M, N] (bf16, row stride y_stride) = x[M, K] (bf16, row stride x_stride) @ W^T (+ bias), W given
 * as panels (see the header). bias: fp32, ceil(N/16)*16 values, or NULL. Returns 0; -1 when the
 * arguments are out of range or the scratch for x could not be allocated; -2 when built without
 * AVX512_BF16. */
int pd_linear_bf16_dot(void *y, const void *x, const void *w_panels, const float *bias, int M, int N, int K,
                       int64_t x_stride, int64_t y_stride, int num_threads) {
#ifndef PD_DOT
    (void)y, (void)x, (void)w_panels, (void)bias, (void)M, (void)N, (void)K, (void)x_stride, (void)y_stride,
        (void)num_threads;
    return -2;
#else
    if (M < 1 || N < 1 || K < 2 || K % 2 != 0) return -1;
    const int KP = K / 2;
    uint32_t *xp = aligned_alloc(64, ((sizeof(uint32_t) * (size_t)M * KP) + 63) / 64 * 64);
    if (xp == NULL) return -1;
    const uint16_t *xs = (const uint16_t *)x, *wp = (const uint16_t *)w_panels;
    const int panels = (N + PANEL - 1) / PANEL;
    const int64_t work = (int64_t)M * N * K / 64;
    const int threads = work < SERIAL_WORK || panels < 2 ? 1 : num_threads;
    /* Blocks of rows whose x pairs fit ROW_BLOCK_BYTES (they stay in L2 while the panels stream by),
     * evened out; block b's pairs start at xp + m0 * KP, laid out [K/2][rows of the block]. */
    const int max_rows = (int)(ROW_BLOCK_BYTES / ((size_t)K * 2)) / MAX_ROWS * MAX_ROWS;
    const int rb0 = max_rows < MAX_ROWS ? MAX_ROWS : max_rows, blocks = (M + rb0 - 1) / rb0;
    const int rb = (M + blocks - 1) / blocks;
#pragma omp parallel num_threads(threads)
    {
        /* Few rows per block: a small transpose; the implicit barrier after the last publishes it. */
        for (int m0 = 0; m0 < M; m0 += rb) {
            const int ld = M - m0 < rb ? M - m0 : rb;
            uint32_t *xb = xp + (size_t)m0 * KP;
#pragma omp for schedule(static)
            for (int kp = 0; kp < KP; kp++)
                for (int i = 0; i < ld; i++)
                    memcpy(xb + (size_t)kp * ld + i, xs + (size_t)(m0 + i) * x_stride + 2 * kp, sizeof *xb);
        }
        int nt = 1, t = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int m0 = 0; m0 < M; m0 += rb)
            block_panels(xp + (size_t)m0 * KP, M - m0 < rb ? M - m0 : rb, m0, wp, K, N, p0, p1, bias, (uint16_t *)y,
                         y_stride);
    }
    free(xp);
    return 0;
#endif
}
