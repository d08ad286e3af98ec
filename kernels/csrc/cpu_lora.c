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
 * Weight layout (kernels/cpu_lora.py LoRAWeights, written only when a slot gets another adapter), fp32:
 *   A  [slots][parts * r][in]          part p's rank row k of slot s at row p*r + k (rows >= rank: unused)
 *   Bt [slots][panels][r][16]          per part, panels of 16 output columns (the last one zero-padded);
 *                                      row k of a panel holds B_part[columns, k]: an expand streams it in order
 *   ranks [slots][parts]               the rank rows each slot has in each part (0: none)
 *
 * Rows are grouped by slot (counting sort) so that all rows of an adapter use its weights while they sit in
 * L1/L2: the shrink splits A into blocks of 4 rows and multiplies each block by every row of its slot; the
 * expand splits the output columns into tiles of 4 panels and runs every row of every slot over each tile.
 * Threads (OpenMP, torch's pool) split the A blocks, then the column tiles: each weight is read by one thread.
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
#endif

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
static void shrink_tile(float *t, int64_t t_stride, int j0, const float *x, int64_t x_stride, const int *rows,
                        int nx, const float *scale, const float *a, int na, int in) {
    const float *ar[SHRINK_A], *xr[SHRINK_X];
    for (int k = 0; k < SHRINK_A; k++) ar[k] = a + (size_t)(k < na ? k : 0) * in;
    for (int i = 0; i < SHRINK_X; i++) xr[i] = x + (size_t)rows[i < nx ? i : 0] * x_stride;
    vf acc[SHRINK_X][SHRINK_A];
    for (int i = 0; i < SHRINK_X; i++)
        for (int k = 0; k < SHRINK_A; k++) acc[i][k] = vzero();
    const int body = in - in % VL;
    for (int c = 0; c < body; c += VL) {
        vf av[SHRINK_A];
        for (int k = 0; k < SHRINK_A; k++) av[k] = vload(ar[k] + c);
        for (int i = 0; i < SHRINK_X; i++) {
            const vf xv = vload(xr[i] + c);
            for (int k = 0; k < SHRINK_A; k++) acc[i][k] = vfma(xv, av[k], acc[i][k]);
        }
    }
    for (int i = 0; i < nx; i++) {
        float *tr = t + (size_t)rows[i] * t_stride + j0;
        for (int k = 0; k < na; k++) {
            float s = vsum(acc[i][k]);
            for (int c = body; c < in; c++) s += xr[i][c] * ar[k][c];
            tr[k] = scale[rows[i]] * s;
        }
    }
}

/* y[row][col0 + c] += t_part[row] . Bt panels (c < nc <= TILE * PANEL), rounded once into y's dtype. */
static void expand_row(void *y, int y_fp32, int64_t y_stride, int row, int col0, int nc, const float *t,
                       const float *bt, int rank, int r, int np) {
    vf acc[TILE * PANEL / VL];
    const int nv = np * PANEL / VL;
    for (int v = 0; v < nv; v++) acc[v] = vzero();
    for (int k = 0; k < rank; k++) {
        const vf tk = vset1(t[k]);
        for (int q = 0; q < np; q++) {
            const float *b = bt + ((size_t)q * r + k) * PANEL;
            for (int v = 0; v < PANEL / VL; v++)
                acc[q * (PANEL / VL) + v] = vfma(tk, vload(b + v * VL), acc[q * (PANEL / VL) + v]);
        }
    }
    float delta[TILE * PANEL];
    for (int v = 0; v < nv; v++) vstore(delta + v * VL, acc[v]);
    if (y_fp32) {
        float *yr = (float *)y + (size_t)row * y_stride + col0;
        for (int c = 0; c < nc; c++) yr[c] += delta[c];
    } else {
        uint16_t *yr = (uint16_t *)y + (size_t)row * y_stride + col0;
        for (int c = 0; c < nc; c++) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + delta[c]);
    }
}

/* y += the adapters' deltas of `rows` rows (see the header). x: [rows, in] bf16 (x_fp32 = 0) or fp32, row
 * stride x_stride; y: [rows, sum(widths)] bf16 or fp32, row stride y_stride; row_slot: int32 [rows], -1 or
 * < slots; row_scale: fp32 [rows]; r: the stack's rank (max_lora_rank). Returns 0, or -1 when scratch memory
 * cannot be had (y untouched). */
int pd_lora_apply(void *y, int y_fp32, int64_t y_stride, const void *x, int x_fp32, int64_t x_stride, int rows,
                  const int32_t *row_slot, const float *row_scale, const float *a, const float *bt,
                  const int32_t *ranks, int slots, int parts, const int32_t *widths, int r, int in,
                  int num_threads) {
    if (rows <= 0) return 0;
    int panels = 0, shrink_items = 0, expand_items = 0;
    for (int p = 0; p < parts; p++) {
        panels += (widths[p] + PANEL - 1) / PANEL;
        expand_items += ((widths[p] + PANEL - 1) / PANEL + TILE - 1) / TILE;
    }
    const int tr = parts * r; /* t's row: every part's r columns */
    const int x_rows = x_fp32 ? 0 : rows;
    size_t bytes = ((size_t)x_rows * in + (size_t)rows * tr) * sizeof(float)
                   + ((size_t)rows + slots + 1 + 3 * (size_t)slots * parts * ((r + SHRINK_A - 1) / SHRINK_A)
                      + 3 * (size_t)expand_items) * sizeof(int);
    float *x32 = scratch_for(bytes);
    if (!x32) return -1;
    float *t = x32 + (size_t)x_rows * in;
    int *order = (int *)(t + (size_t)rows * tr); /* rows by slot; slot s's at [start[s], start[s + 1]) */
    int *start = order + rows;
    int *shrink = start + slots + 1;             /* (slot, first A row, A rows) per shrink block */
    int *expand = shrink + 3 * (size_t)slots * parts * ((r + SHRINK_A - 1) / SHRINK_A); /* (part, panel, n) */

    memset(start, 0, (slots + 1) * sizeof(int));
    for (int i = 0; i < rows; i++)
        if (row_slot[i] >= 0 && row_slot[i] < slots) start[row_slot[i] + 1]++;
    for (int s = 0; s < slots; s++) start[s + 1] += start[s];
    {
        int fill[slots > 0 ? slots : 1];
        memcpy(fill, start, slots * sizeof(int));
        for (int i = 0; i < rows; i++)
            if (row_slot[i] >= 0 && row_slot[i] < slots) order[fill[row_slot[i]]++] = i;
    }
    const int used_rows = start[slots];
    if (used_rows == 0) return 0;
    int64_t work = 0;
    for (int s = 0; s < slots; s++) {
        const int n = start[s + 1] - start[s];
        if (n == 0) continue;
        for (int p = 0; p < parts; p++) {
            const int rank = ranks[s * parts + p];
            work += (int64_t)n * rank * (in + widths[p]);
            for (int k = 0; k < rank; k += SHRINK_A) {
                shrink[3 * shrink_items] = s;
                shrink[3 * shrink_items + 1] = p * r + k;
                shrink[3 * shrink_items + 2] = rank - k < SHRINK_A ? rank - k : SHRINK_A;
                shrink_items++;
            }
        }
    }
    if (shrink_items == 0) return 0; /* no used slot has pairs on this layer */
    expand_items = 0;
    for (int p = 0, panel = 0; p < parts; p++) {
        const int np = (widths[p] + PANEL - 1) / PANEL;
        for (int q = 0; q < np; q += TILE) {
            expand[3 * expand_items] = p;
            expand[3 * expand_items + 1] = panel + q;
            expand[3 * expand_items + 2] = np - q < TILE ? np - q : TILE;
            expand_items++;
        }
        panel += np;
    }
    const float *xf = x_fp32 ? (const float *)x : x32;
    const int64_t xs = x_fp32 ? x_stride : in;
    const int threads = work < SERIAL_WORK ? 1 : num_threads;

#pragma omp parallel num_threads(threads)
    {
        if (!x_fp32) { /* only the rows under an adapter are widened */
#pragma omp for schedule(static)
            for (int i = 0; i < used_rows; i++) {
                const uint16_t *src = (const uint16_t *)x + (size_t)order[i] * x_stride;
                float *dst = x32 + (size_t)order[i] * in;
                for (int c = 0; c < in; c++) dst[c] = bf16_to_f32(src[c]);
            }
        }
#pragma omp for schedule(static)
        for (int b = 0; b < shrink_items; b++) {
            const int s = shrink[3 * b], j0 = shrink[3 * b + 1], na = shrink[3 * b + 2];
            const float *ab = a + ((size_t)s * tr + j0) * in;
            for (int i = start[s]; i < start[s + 1]; i += SHRINK_X) {
                const int nx = start[s + 1] - i < SHRINK_X ? start[s + 1] - i : SHRINK_X;
                shrink_tile(t, tr, j0, xf, xs, order + i, nx, row_scale, ab, na, in);
            }
        }
#pragma omp for schedule(static)
        for (int e = 0; e < expand_items; e++) {
            const int p = expand[3 * e], panel = expand[3 * e + 1], np = expand[3 * e + 2];
            int col0 = 0, first = 0; /* the part's first column and first panel */
            for (int q = 0; q < p; q++) {
                col0 += widths[q];
                first += (widths[q] + PANEL - 1) / PANEL;
            }
            col0 += (panel - first) * PANEL;
            const int end = col0 + np * PANEL, part_end = col0 - (panel - first) * PANEL + widths[p];
            const int nc = (end < part_end ? end : part_end) - col0;
            for (int s = 0; s < slots; s++) {
                const int rank = ranks[s * parts + p];
                if (rank == 0) continue;
                const float *bp = bt + ((size_t)s * panels + panel) * r * PANEL;
                for (int i = start[s]; i < start[s + 1]; i++)
                    expand_row(y, y_fp32, y_stride, order[i], col0, nc, t + (size_t)order[i] * tr + p * r, bp,
                               rank, r, np);
            }
        }
    }
    return 0;
}
