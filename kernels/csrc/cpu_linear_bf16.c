/* y = x @ W^T (+ bias) for a few rows of x and bfloat16 weights, on CPUs without bf16 instructions.
 *
 * Decode steps multiply a handful of activation rows by every weight matrix: the product is
 * bound by reading the weights. On CPUs without bf16 matmul instructions (AVX2-only) torch's
 * bf16 GEMM is emulated and slow, and the fp32 copy of the weights the engine packs for
 * prefill (engine/models/linear.py) is twice the bytes to read. This kernel reads the bf16
 * weights themselves, widens them to fp32 in registers (a 16-bit shift) and accumulates in
 * fp32, as a bf16 GEMM does: for one row it is several times faster than the fp32 packed GEMM.
 *
 * Tiles of up to 3 activation rows x 4 weight rows keep 12 accumulators in registers; weight
 * tiles are spread over the threads. x, bias and y are bf16 ([M, K], [N], [M, N], rows dense
 * with the given row strides); accumulation and the bias add are fp32, the result rounded to
 * nearest even. Needs K % 8 == 0 (kernels/cpu_linear.py checks). Built at first use by
 * kernels/cpu_build.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

#define MAX_ROWS 64         /* activation rows per call (the caller splits larger batches) */
#define SERIAL_WORK 262144  /* rows x N x K / 64 below which one thread does it all */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef PD_AVX2
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[i][j] = x[m + i] . w[n + j] for an MB x 4 tile; one function per MB so that the
 * accumulators are fixed-size arrays the compiler keeps in registers. */
#define DEFINE_TILE(MB)                                                                          \
    static void tile_##MB(const float *x, const uint16_t *w, float *out, int m, int n, int K) { \
        __m256 acc[MB][4];                                                                       \
        for (int i = 0; i < MB; i++)                                                             \
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();                         \
        for (int k = 0; k < K; k += 8) {                                                         \
            __m256 wv[4];                                                                        \
            for (int j = 0; j < 4; j++) wv[j] = widen8(w + (size_t)(n + j) * K + k);             \
            for (int i = 0; i < MB; i++) {                                                       \
                const __m256 xv = _mm256_loadu_ps(x + (size_t)(m + i) * K + k);                  \
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);   \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < MB; i++)                                                             \
            for (int j = 0; j < 4; j++) out[i * 4 + j] = hsum8(acc[i][j]);                       \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
#endif

/* Rows [0, M) against weight rows [n, n + nb), nb <= 4: out[m][j] (row stride 4). */
static void column_block(const float *x, const uint16_t *w, float *out, int M, int n, int nb, int K) {
#ifdef PD_AVX2
    if (nb == 4) {
        int m = 0;
        for (; m + 3 <= M; m += 3) tile_3(x, w, out + m * 4, m, n, K);
        if (M - m == 2) tile_2(x, w, out + m * 4, m, n, K);
        else if (M - m == 1) tile_1(x, w, out + m * 4, m, n, K);
        return;
    }
#endif
    for (int m = 0; m < M; m++)
        for (int j = 0; j < nb; j++) {
            const uint16_t *wr = w + (size_t)(n + j) * K;
            const float *xr = x + (size_t)m * K;
            float s = 0.f;
            for (int k = 0; k < K; k++) s += xr[k] * bf16_to_f32(wr[k]);
            out[m * 4 + j] = s;
        }
}

/* y[M, N] (bf16, row stride y_stride) = x[M, K] (bf16, row stride x_stride) @ w[N, K]^T (+ bias[N]).
 * bias may be NULL. Returns 0, -1 when M > MAX_ROWS or scratch could not be allocated. */
int pd_linear_bf16(void *y, const void *x, const void *w, const void *bias, int M, int N, int K, int64_t x_stride,
                   int64_t y_stride, int num_threads) {
    if (M > MAX_ROWS || M < 1) return -1;
    float *xf = malloc(sizeof(float) * (size_t)M * K);
    if (xf == NULL) return -1;
    const uint16_t *xs = (const uint16_t *)x, *wb = (const uint16_t *)w, *bb = (const uint16_t *)bias;
    uint16_t *ys = (uint16_t *)y;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) xf[(size_t)m * K + k] = bf16_to_f32(xs[(size_t)m * x_stride + k]);
    const int blocks = (N + 3) / 4;
    const int64_t work = (int64_t)M * N * K / 64;
    int threads = work < SERIAL_WORK ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int blk = 0; blk < blocks; blk++) {
        float out[MAX_ROWS * 4];
        const int n = blk * 4, nb = N - n < 4 ? N - n : 4;
        column_block(xf, wb, out, M, n, nb, K);
        for (int m = 0; m < M; m++)
            for (int j = 0; j < nb; j++) {
                float v = out[m * 4 + j];
                if (bb != NULL) v += bf16_to_f32(bb[n + j]);
                ys[(size_t)m * y_stride + n + j] = f32_to_bf16(v);
            }
    }
    free(xf);
    return 0;
}
