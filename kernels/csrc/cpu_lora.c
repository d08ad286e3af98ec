/* Multi-LoRA on the rows of a decode step, one call per wrapped linear layer (punica's bgmv, on the CPU).
 *
 * Each row carries its adapter's slot (-1: the base model, nothing added) and scaling. For a row of slot s:
 *   t = scaling * (x_row A_s^T)                     only the rank rows slot s uses of each part
 *   y_row[part columns] += t_part B_part^T          in fp32, rounded once into y's dtype (bf16 or fp32)
 * as PEFT adds its fp32 delta. The torch path this replaces (engine/lora/stacked.py) costs 4 + parts ops a
 * layer, converts x and y to fp32 and back as whole tensors, and multiplies every row by every slot's pairs;
 * a decode step of a small model makes ~120 such layer calls, so op overhead and the extra traffic were the
 * cost. Here one call reads each used slot's non-zero weights once and each row of x and y once.
 *
 * Weight layout (kernels/cpu_lora.py LoRAWeights, written only when a slot gets another adapter), fp32, or bf16
 * (w_bf16: the adapter's weights held in a bf16 model's dtype, `--lora-dtype auto` as vLLM does; widened to fp32
 * in registers, so a decode step reads half the bytes, which is what it waits for):
 *   A  [slots][parts * r][in]          part p's rank row k of slot s at row p*r + k (rows >= rank: unused)
 *   Bt [slots][panels][r][16]          per part, panels of 16 output columns (the last one zero-padded);
 *                                      row k of a panel holds B_part[columns, k]: an expand streams it in order
 *   ranks [slots][parts]               the rank rows each slot has in each part (0: none)
 *
 * Rows are grouped by slot (counting sort) so that all rows of an adapter use its weights while they sit in
 * L1: the shrink multiplies each block of 4 A rows by every row of the slot, the expand each tile of 4 Bt
 * panels (64 columns). Threads (OpenMP, torch's pool) take equal runs of the sorted rows, with no barrier
 * inside a call (see pd_lora_apply).
 * Vector paths: AVX-512F (16 lanes), AVX2 + FMA (8), plain C; all accumulate in fp32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define SHRINK_X 4 /* x rows per shrink tile: 16 accumulators + 8 loads of 32 zmm */
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float s) { return _mm512_set1_ps(s); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define SHRINK_X 2 /* 8 accumulators + 6 loads of 16 ymm */
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset1(float s) { return _mm256_set1_ps(s); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define VL 1 /* plain C: the compiler vectorizes what it can */
#define SHRINK_X 2
typedef float vf;
static inline vf vzero(void) { return 0.f; }
static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf v) { *p = v; }
static inline vf vset1(float s) { return s; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf v) { return v; }
static inline vf vload_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
#endif

/* Weights at element offset i of w, fp32 or bf16 (wb): a constant after inlining, so each path is its own loop. */
static inline __attribute__((always_inline)) vf wload(const void *w, size_t i, int wb) {
    return wb ? vload_bf16((const uint16_t *)w + i) : vload((const float *)w + i);
}
static inline __attribute__((always_inline)) float wget(const void *w, size_t i, int wb) {
    return wb ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#define PANEL 16     /* output columns per Bt panel */
#define SHRINK_A 4   /* A rows per shrink block */
#define TILE 4       /* panels per expand tile: 64 columns */
#define SERIAL_WORK (1 << 16) /* multiply-adds below which one thread does it all (a fork costs more) */

/* Per calling thread, grown as needed: a decode step makes ~120 calls, and a fresh malloc of a few hundred
 * KiB is an mmap and page faults each time. */
static __thread void *scratch;
static __thread size_t scratch_bytes;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        void *grown = realloc(scratch, bytes);
        if (!grown) return NULL;
        scratch = grown;
        scratch_bytes = bytes;
    }
    return scratch;
}

/* t[rows[i]][j0 + a] = scale[rows[i]] * (x[rows[i]] . A[a]) for a < na (<= SHRINK_A), i < nx (<= SHRINK_X).
 * Missing rows of a short block point at row 0 of it: the tile stays branch-free, the extra sums are dropped. */
static inline __attribute__((always_inline)) void shrink_tile(float *t, int64_t t_stride, int j0, const float *x,
                                                              int64_t x_stride, const int *rows, int nx,
                                                              const float *scale, const void *a, size_t a_off,
                                                              int na, int in, int wb) {
    const float *xr[SHRINK_X];
    size_t ar[SHRINK_A];
    for (int k = 0; k < SHRINK_A; k++) ar[k] = a_off + (size_t)(k < na ? k : 0) * in;
    for (int i = 0; i < SHRINK_X; i++) xr[i] = x + (size_t)rows[i < nx ? i : 0] * x_stride;
    vf acc[SHRINK_X][SHRINK_A];
    for (int i = 0; i < SHRINK_X; i++)
        for (int k = 0; k < SHRINK_A; k++) acc[i][k] = vzero();
    const int body = in - in % VL;
    for (int c = 0; c < body; c += VL) {
        vf av[SHRINK_A];
        for (int k = 0; k < SHRINK_A; k++) av[k] = wload(a, ar[k] + c, wb);
        for (int i = 0; i < SHRINK_X; i++) {
            const vf xv = vload(xr[i] + c);
            for (int k = 0; k < SHRINK_A; k++) acc[i][k] = vfma(xv, av[k], acc[i][k]);
        }
    }
    for (int i = 0; i < nx; i++) {
        float *tr = t + (size_t)rows[i] * t_stride + j0;
        for (int k = 0; k < na; k++) {
            float s = vsum(acc[i][k]);
            for (int c = body; c < in; c++) s += xr[i][c] * wget(a, ar[k] + c, wb);
            tr[k] = scale[rows[i]] * s;
        }
    }
}

/* y[row][col0 + c] += t_part[row] . Bt panels (c < nc <= np * PANEL), rounded once into y's dtype. Inlined with
 * a constant np (the full tile) so the accumulators stay in registers: with a variable count they live on the
 * stack and every multiply-add waits for the previous one's store. */
static inline __attribute__((always_inline)) void expand_tile(void *y, int y_fp32, int64_t y_stride, int row,
                                                              int col0, int nc, const float *t, const void *bt,
                                                              size_t bt_off, int rank, int r, const int np,
                                                              const int wb) {
    vf acc[TILE * PANEL / VL];
    for (int v = 0; v < np * PANEL / VL; v++) acc[v] = vzero();
    for (int k = 0; k < rank; k++) {
        const vf tk = vset1(t[k]);
        for (int q = 0; q < np; q++) {
            const size_t b = bt_off + ((size_t)q * r + k) * PANEL;
            for (int v = 0; v < PANEL / VL; v++)
                acc[q * (PANEL / VL) + v] = vfma(tk, wload(bt, b + v * VL, wb), acc[q * (PANEL / VL) + v]);
        }
    }
    float delta[TILE * PANEL];
    for (int v = 0; v < np * PANEL / VL; v++) vstore(delta + v * VL, acc[v]);
    if (y_fp32) {
        float *yr = (float *)y + (size_t)row * y_stride + col0;
        for (int c = 0; c < nc; c++) yr[c] += delta[c];
    } else {
        uint16_t *yr = (uint16_t *)y + (size_t)row * y_stride + col0;
        for (int c = 0; c < nc; c++) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + delta[c]);
    }
}

static inline __attribute__((always_inline)) void expand_row(void *y, int y_fp32, int64_t y_stride, int row,
                                                             int col0, int nc, const float *t, const void *bt,
                                                             size_t bt_off, int rank, int r, int np, int wb) {
    if (np == TILE)
        expand_tile(y, y_fp32, y_stride, row, col0, nc, t, bt, bt_off, rank, r, TILE, wb);
    else if (np == 1)
        expand_tile(y, y_fp32, y_stride, row, col0, nc, t, bt, bt_off, rank, r, 1, wb);
    else
        expand_tile(y, y_fp32, y_stride, row, col0, nc, t, bt, bt_off, rank, r, np, wb);
}

/* One thread's share: rows [lo, hi) of `order` (sorted by slot). For each slot's run of them: widen x, shrink
 * A block by A block over those rows, then expand column tile by column tile over them. */
static inline __attribute__((always_inline)) void apply_rows(
        void *y, int y_fp32, int64_t y_stride, const void *x, int x_fp32, int64_t x_stride, const int *order, int lo,
        int hi, const int32_t *row_slot, const float *row_scale, const void *a, const void *bt, const int32_t *ranks,
        int parts, const int32_t *widths, int panels, int r, int in, float *x32, float *t, const int wb) {
    const int tr = parts * r;
    const float *xf = x_fp32 ? (const float *)x : x32;
    const int64_t xs = x_fp32 ? x_stride : in;
    for (int i = lo, end; i < hi; i = end) {
        const int s = row_slot[order[i]];
        for (end = i + 1; end < hi && row_slot[order[end]] == s; end++) {}
        if (!x_fp32)
            for (int j = i; j < end; j++) {
                const uint16_t *src = (const uint16_t *)x + (size_t)order[j] * x_stride;
                float *dst = x32 + (size_t)order[j] * in;
                for (int c = 0; c < in; c++) dst[c] = bf16_to_f32(src[c]);
            }
        for (int p = 0; p < parts; p++) {
            const int rank = ranks[s * parts + p];
            for (int k = 0; k < rank; k += SHRINK_A) { /* the A block stays in L1 over the rows */
                const size_t ab = ((size_t)s * tr + p * r + k) * in;
                const int na = rank - k < SHRINK_A ? rank - k : SHRINK_A;
                for (int j = i; j < end; j += SHRINK_X)
                    shrink_tile(t, tr, p * r + k, xf, xs, order + j, end - j < SHRINK_X ? end - j : SHRINK_X,
                                row_scale, a, ab, na, in, wb);
            }
        }
        for (int p = 0, col0 = 0, panel = 0; p < parts; col0 += widths[p], panel += (widths[p] + PANEL - 1) / PANEL,
             p++) {
            const int rank = ranks[s * parts + p];
            if (rank == 0) continue;
            for (int c = 0; c < widths[p]; c += TILE * PANEL) { /* the Bt tile stays in L1 over the rows */
                const int nc = widths[p] - c < TILE * PANEL ? widths[p] - c : TILE * PANEL;
                const size_t bp = ((size_t)s * panels + panel + c / PANEL) * r * PANEL;
                for (int j = i; j < end; j++)
                    expand_row(y, y_fp32, y_stride, order[j], col0 + c, nc, t + (size_t)order[j] * tr + p * r, bt,
                               bp, rank, r, (nc + PANEL - 1) / PANEL, wb);
            }
        }
    }
}

/* y += the adapters' deltas of `rows` rows (see the header). x: [rows, in] bf16 (x_fp32 = 0) or fp32, row
 * stride x_stride; y: [rows, sum(widths)] bf16 or fp32, row stride y_stride; row_slot: int32 [rows], -1 or
 * < slots; row_scale: fp32 [rows]; a, bt: fp32, or bf16 when w_bf16; r: the stack's rank (max_lora_rank).
 * Returns 0, or -1 when scratch memory
 * cannot be had (y untouched).
 *
 * Threads split the rows under an adapter, sorted by slot, into equal runs: no thread waits for another inside
 * the call (engines wait passively, so every OpenMP barrier is a futex wake-up, ~10 us; a decode step makes
 * ~120 of these calls). With several adapters a slot's weights are mostly read by one thread; a slot whose rows
 * two threads share is read by both (from L3 for the second). */
int pd_lora_apply(void *y, int y_fp32, int64_t y_stride, const void *x, int x_fp32, int64_t x_stride, int rows,
                  const int32_t *row_slot, const float *row_scale, const void *a, const void *bt, int w_bf16,
                  const int32_t *ranks, int slots, int parts, const int32_t *widths, int r, int in,
                  int num_threads) {
    if (rows <= 0) return 0;
    int panels = 0;
    for (int p = 0; p < parts; p++) panels += (widths[p] + PANEL - 1) / PANEL;
    const int x_rows = x_fp32 ? 0 : rows;
    const size_t bytes = ((size_t)x_rows * in + (size_t)rows * parts * r) * sizeof(float)
                         + ((size_t)rows + slots + 1) * sizeof(int);
    float *x32 = scratch_for(bytes);
    if (!x32) return -1;
    float *t = x32 + (size_t)x_rows * in;
    int *order = (int *)(t + (size_t)rows * parts * r); /* rows under an adapter, by slot (counting sort) */
    int *next = order + rows;
    memset(next, 0, (slots + 1) * sizeof(int));
    for (int i = 0; i < rows; i++)
        if (row_slot[i] >= 0 && row_slot[i] < slots) next[row_slot[i] + 1]++;
    for (int s = 0; s < slots; s++) next[s + 1] += next[s];
    const int used = next[slots];
    for (int i = 0; i < rows; i++)
        if (row_slot[i] >= 0 && row_slot[i] < slots) order[next[row_slot[i]]++] = i;
    if (used == 0) return 0;
    int64_t work = 0; /* multiply-adds */
    for (int i = 0; i < used; i++)
        for (int p = 0; p < parts; p++) work += (int64_t)ranks[row_slot[order[i]] * parts + p] * (in + widths[p]);
    if (work == 0) return 0; /* no used slot has pairs on this layer */
    int threads = work < SERIAL_WORK ? 1 : num_threads < used ? num_threads : used;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int nt = 1, id = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        id = omp_get_thread_num();
#endif
        const int lo = (int)((int64_t)used * id / nt), hi = (int)((int64_t)used * (id + 1) / nt);
        if (w_bf16)
            apply_rows(y, y_fp32, y_stride, x, x_fp32, x_stride, order, lo, hi, row_slot, row_scale, a, bt, ranks,
                       parts, widths, panels, r, in, x32, t, 1);
        else
            apply_rows(y, y_fp32, y_stride, x, x_fp32, x_stride, order, lo, hi, row_slot, row_scale, a, bt, ranks,
                       parts, widths, panels, r, in, x32, t, 0);
    }
    return 0;
}
