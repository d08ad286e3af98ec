/* Causal attention of a prefill chunk's queries over their keys and values, bf16, on CPUs with the
 * AVX512_BF16 dot instruction, or AVX-512 CPUs without it (the instruction's products by FMAs): a
 * prompt with no cached history over its own new K/V rows, or a chunk over the paged KV cache (its
 * history and, already written there, its own rows).
 *
 * torch's CPU scaled_dot_product_attention runs this at ~30 GFLOP/s on a 2-core Zen 4 (its bf16
 * matmuls have no dot-instruction path there), so prompt attention took a fifth of a prefill-bound
 * batch's time; the dot instruction reaches ~400 (kernels/csrc/cpu_linear_avx512bf16.c). Same
 * arithmetic as torch's CPU flash attention: scores are fp32 sums of exact bf16 products, scaled in
 * fp32 and masked causally; the softmax is fp32 (here over a row's whole causal span at once, so no
 * rescaling); the exponentials are rounded to bf16 for the product with V (as torch does for bf16),
 * their fp32 sum divides the fp32 result, which is rounded to bf16 once.
 *
 * Layout. K and V of each kv head are repacked once per call so both products are dot-instruction
 * tiles: K as [key block of 16][dim pair][16 keys][2] (scores: 16 keys per vector, a broadcast query
 * dim pair), V as [key pair][dim][2] (outputs: 16 dims per vector, a broadcast pair of
 * probabilities). Work items are (kv head, QB query positions): the positions' rows for all query
 * heads of that kv head (GQA) share the packed K/V; items with the most keys go first.
 *
 * kernels/cpu_prefill_attention.py checks shapes and strides; head_dim must be a multiple of 64.
 * Builds without AVX-512 (F, BW, VL) compile to `pd_prefill_attention_available() == 0` (then the
 * caller keeps torch's attention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PD_PREFILL 1
#include <immintrin.h>

#include "bf16.h"
#include "vec_exp.h"
#ifdef __AVX512BF16__
#define PD_DOT(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
static inline __m256i pd_round_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
/* The dot instruction's arithmetic without it (AVX-512 CPUs without AVX512_BF16): per 32-bit lane, the
 * product of the high bf16 halves, then of the low ones, added by fp32 FMAs. (The instruction also
 * reads denormal inputs as zero; a softmax's probabilities and a model's K/V rarely hold one.) After
 * unrolling, each split of a tile's shared operand is computed once. */
static inline __m512 pd_dot(__m512 acc, __m512i a, __m512i b) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)),
                          acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                           acc);
}
#define PD_DOT(acc, a, b) pd_dot((acc), (a), (b))
/* vcvtneps2bf16 without it: bf16.h's integer rounding. */
static inline __m256i pd_round_bf16(__m512 v) { return bf16x16_round_int(v); }
#endif
#endif

#define QB 16 /* query positions per work item */
#define RT 4  /* query rows per register tile */
#define KT 4  /* 16-key blocks per score tile (keys are padded to whole tiles) */
#define DT 4  /* 16-dim vectors per output tile (head_dim % 64 == 0) */

int pd_prefill_attention_available(void) {
#ifdef PD_PREFILL
    return 1;
#else
    return 0;
#endif
}

#ifdef PD_PREFILL
static inline uint32_t pair_at(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Where key j's row is: row j of dense K/V, or its slot in the paged cache (block_table given). */
typedef struct {
    const uint16_t *k, *v;
    int64_t k_stride, v_stride; /* elements between rows (dense) or slots (paged) */
    const int32_t *block_table;
    int block_size;
} KvRows;

static inline int64_t kv_row(const KvRows *kv, int j) {
    return kv->block_table ? (int64_t)kv->block_table[j / kv->block_size] * kv->block_size + j % kv->block_size : j;
}

/* kp[kb][t][16][2] for kv head g: key block kb, dim pair t; keys past L are zero. */
static void pack_k(uint16_t *kp, const KvRows *kv, int g, int L, int nkb, int D) {
    const int T = D / 2;
    for (int kb = 0; kb < nkb; kb++)
        for (int j = 0; j < 16; j++) {
            const int key = kb * 16 + j;
            uint32_t *dst = (uint32_t *)kp + (size_t)kb * T * 16 + j;
            if (key >= L) {
                for (int t = 0; t < T; t++) dst[t * 16] = 0;
                continue;
            }
            const uint16_t *src = kv->k + kv_row(kv, key) * kv->k_stride + (int64_t)g * D;
            for (int t = 0; t < T; t++) dst[t * 16] = pair_at(src + 2 * t);
        }
}

/* vp[jp][D][2] for kv head g: values of keys 2jp and 2jp+1 side by side; a missing last key is zero. */
static void pack_v(uint16_t *vp, const KvRows *kv, int g, int L, int njp, int D) {
    for (int jp = 0; jp < njp; jp++) {
        const uint16_t *a = kv->v + kv_row(kv, 2 * jp) * kv->v_stride + (int64_t)g * D;
        const uint16_t *b = 2 * jp + 1 < L ? kv->v + kv_row(kv, 2 * jp + 1) * kv->v_stride + (int64_t)g * D : NULL;
        uint16_t *dst = vp + (size_t)jp * D * 2;
        for (int d = 0; d < D; d++) {
            dst[2 * d] = a[d];
            dst[2 * d + 1] = b ? b[d] : 0;
        }
    }
}

typedef struct {
    const uint16_t *q, *kp, *vp;
    uint16_t *out;
    int64_t q_stride, out_stride;
    int L, ctx, G, D, nkb_all; /* L query rows at positions ctx..ctx+L-1, over ctx + L keys */
    float scale;
} Job;

/* Row r of item (g, qb): query row qb*QB + r/G (position ctx + that), query head g*G + r%G. */
static inline int64_t row_pos(int qb, int r, int G) { return (int64_t)qb * QB + r / G; }
static inline int row_head(int g, int r, int G) { return g * G + r % G; }

static void item(const Job *j, int g, int qb, float *S, uint16_t *P, float *sums) {
    const int G = j->G, D = j->D, T = D / 2;
    const int last = (qb + 1) * QB < j->L ? (qb + 1) * QB : j->L; /* one past the item's last position */
    const int rows = (last - qb * QB) * G, nk = j->ctx + last;
    const int nkb = (((nk + 15) / 16 + KT - 1) / KT) * KT, kpad = nkb * 16, njp = (nk + 1) / 2;
    const uint16_t *kp = j->kp + (size_t)g * j->nkb_all * T * 32;
    const uint16_t *vp = j->vp + (size_t)g * ((j->ctx + j->L + 1) / 2) * D * 2;
    const __m512 scale = _mm512_set1_ps(j->scale);

    /* Scores: S[r][0, kpad) = scale * q_r . k_j. */
    for (int r0 = 0; r0 < rows; r0 += RT) {
        const uint16_t *qr[RT];
        for (int y = 0; y < RT; y++) {
            const int r = r0 + y < rows ? r0 + y : rows - 1;
            qr[y] = j->q + row_pos(qb, r, G) * j->q_stride + (int64_t)row_head(g, r, G) * D;
        }
        for (int kb0 = 0; kb0 < nkb; kb0 += KT) {
            __m512 acc[RT][KT];
            for (int y = 0; y < RT; y++)
                for (int x = 0; x < KT; x++) acc[y][x] = _mm512_setzero_ps();
            const uint16_t *kt = kp + (size_t)kb0 * T * 32;
            for (int t = 0; t < T; t++) {
                __m512i kv[KT];
                for (int x = 0; x < KT; x++) kv[x] = _mm512_loadu_si512(kt + ((size_t)x * T + t) * 32);
                for (int y = 0; y < RT; y++) {
                    const __m512i qq = _mm512_set1_epi32((int)pair_at(qr[y] + 2 * t));
                    for (int x = 0; x < KT; x++)
                        acc[y][x] = PD_DOT(acc[y][x], qq, kv[x]);
                }
            }
            for (int y = 0; y < RT && r0 + y < rows; y++)
                for (int x = 0; x < KT; x++)
                    _mm512_storeu_ps(S + (size_t)(r0 + y) * kpad + (kb0 + x) * 16, _mm512_mul_ps(acc[y][x], scale));
        }
    }
    /* Softmax over each row's causal span [0, pos]; P = bf16(exp(s - max)), zero past the span. */
    for (int r = 0; r < rows; r++) {
        const int n = j->ctx + (int)row_pos(qb, r, G) + 1;
        float *s = S + (size_t)r * kpad;
        uint16_t *p = P + (size_t)r * kpad;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, m, s + i));
        }
        const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < kpad; i += 16) {
            const __mmask16 m = i >= n ? 0 : n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmax)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(p + i), pd_round_bf16(e));
        }
        sums[r] = _mm512_reduce_add_ps(sum);
    }
    /* Outputs: out_r = (sum_j P[r][j] v_j) / l_r, rounded to bf16. */
    for (int r0 = 0; r0 < rows; r0 += RT) {
        const uint16_t *pr[RT];
        for (int y = 0; y < RT; y++) pr[y] = P + (size_t)(r0 + y < rows ? r0 + y : rows - 1) * kpad;
        for (int d0 = 0; d0 < D; d0 += DT * 16) {
            __m512 acc[RT][DT];
            for (int y = 0; y < RT; y++)
                for (int x = 0; x < DT; x++) acc[y][x] = _mm512_setzero_ps();
            for (int jp = 0; jp < njp; jp++) {
                __m512i vv[DT];
                for (int x = 0; x < DT; x++) vv[x] = _mm512_loadu_si512(vp + ((size_t)jp * D + d0 + 16 * x) * 2);
                for (int y = 0; y < RT; y++) {
                    const __m512i pp = _mm512_set1_epi32((int)pair_at(pr[y] + 2 * jp));
                    for (int x = 0; x < DT; x++)
                        acc[y][x] = PD_DOT(acc[y][x], pp, vv[x]);
                }
            }
            for (int y = 0; y < RT && r0 + y < rows; y++) {
                const int r = r0 + y;
                uint16_t *o = j->out + row_pos(qb, r, G) * j->out_stride + (int64_t)row_head(g, r, G) * D + d0;
                const __m512 l = _mm512_set1_ps(sums[r]);
                for (int x = 0; x < DT; x++) {
                    _mm256_storeu_si256((__m256i *)(o + 16 * x), pd_round_bf16(_mm512_div_ps(acc[y][x], l)));
                }
            }
        }
    }
}
#endif

/* out[i, h, :] = causal attention of query row (i, h), at position ctx + i, over keys/values
 * [0, ctx + i] of kv head h / (H / KVH). Rows are q_stride / out_stride elements apart, heads dense within
 * a row. Keys/values: without a block table, rows k_stride / v_stride elements apart; with one, k and v
 * are the cache's K and V halves ([slot][KVH][D], k_stride = v_stride = KVH * D) and key j sits in slot
 * block_table[j / block_size] * block_size + j % block_size.
 * Returns 0; -1 when scratch could not be allocated; -2 when this build has no AVX-512. */
int pd_prefill_attention(uint16_t *out, const uint16_t *q, const uint16_t *k, const uint16_t *v, int L, int ctx,
                         int H, int KVH, int D, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                         int64_t out_stride, const int32_t *block_table, int block_size, float scale, int nthreads) {
#ifndef PD_PREFILL
    (void)out; (void)q; (void)k; (void)v; (void)L; (void)ctx; (void)H; (void)KVH; (void)D; (void)q_stride;
    (void)k_stride; (void)v_stride; (void)out_stride; (void)block_table; (void)block_size; (void)scale;
    (void)nthreads;
    return -2;
#else
    if (L <= 0) return 0;
    const int G = H / KVH, T = D / 2, nkv = ctx + L;
    const int nkb_all = (((nkv + 15) / 16 + KT - 1) / KT) * KT, njp_all = (nkv + 1) / 2;
    const KvRows kv = {k, v, k_stride, v_stride, block_table, block_size};
    uint16_t *kp = aligned_alloc(64, (size_t)KVH * nkb_all * T * 32 * 2 + 64);
    uint16_t *vp = aligned_alloc(64, (size_t)KVH * njp_all * D * 2 * 2 + 64);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int g = 0; g < KVH; g++) {
        pack_k(kp + (size_t)g * nkb_all * T * 32, &kv, g, nkv, nkb_all, D);
        pack_v(vp + (size_t)g * njp_all * D * 2, &kv, g, nkv, njp_all, D);
    }
    const Job job = {q, kp, vp, out, q_stride, out_stride, L, ctx, G, D, nkb_all, scale};
    const int nqb = (L + QB - 1) / QB, items = nqb * KVH, rows = QB * G, kpad = nkb_all * 16;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *S = malloc((size_t)rows * kpad * sizeof(float));
        uint16_t *P = malloc((size_t)rows * kpad * sizeof(uint16_t));
        float *l = malloc((size_t)rows * sizeof(float));
        if (!S || !P || !l) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) /* last positions (most keys) first */
            if (!failed) item(&job, it % KVH, nqb - 1 - it / KVH, S, P, l);
        free(S);
        free(P);
        free(l);
    }
    free(kp);
    free(vp);
    return failed ? -1 : 0;
#endif
}
