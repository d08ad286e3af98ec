/* Paged decode attention for CPUs: one query row per request, keys and values read in place.
 *
 * The torch reference copies every request's KV blocks out of paged memory before attending
 * (an index_select per layer, as many bytes as the attention itself reads). This kernel walks
 * each request's block table instead and reads every key and value once, block by block: a
 * block's K (or V) for all kv heads is one contiguous run of block_size * kv_heads * head_dim
 * elements, so the reads stream through memory (one head at a time over all tokens would touch
 * 128 of every 1024 bytes and stall on memory).
 *
 * Work is split flash-decoding style into (request, partition of PART_TOKENS keys) items so
 * that a few long requests still keep every thread busy: each item computes its scores (fp32),
 * their max and exp-sum and the weighted sum of values; a second loop merges a request's
 * partitions exactly (rescaling by exp(m_p - m)). The query heads that share a kv head (GQA)
 * share its K/V reads. Paths: bf16 caches on AVX-512F/BW/VL builds take
 * cpu_decode_attention_avx512.h (any head_dim and group; vdpbf16ps scores with avx512_bf16);
 * otherwise AVX2+FMA builds use the vector code of cpu_decode_attention_avx2.h for head_dim % 8 == 0
 * and groups 1, 2, 4, 8; everything else takes the plain C loops (same arithmetic, fp32 accumulation). All three are
 * tested on any machine that can run them (tests/kernels/test_cpu_decode_attention.py builds lower ISA levels).
 *
 * Built at first use by common/native_build.py (plain C, no torch headers: it compiles in about a
 * second) and called through ctypes with raw pointers; kernels/cpu_attention.py checks shapes,
 * dtypes and strides first. KV layout: see kernels/torch_ref.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PD_AVX512 1 /* bf16 caches: cpu_decode_attention_avx512.h */
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define PART_TOKENS 256   /* keys per work item */
#define MAX_GROUP 16      /* query heads per kv head (kernels/cpu_attention.py checks) */
#define SERIAL_WORK 16384 /* keys x query heads below which one thread does it all */

#include "bf16.h"

/* `n` elements of dtype `dt` at `src` as fp32 in `dst`. */
static inline void load_row(float *restrict dst, const void *restrict src, int n, int dt) {
    if (dt == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const _Float16 *s = (const _Float16 *)src;
        for (int i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

static inline void store_row(void *restrict dst, const float *restrict src, int n, int dt) {
    if (dt == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dt == DT_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *d = (_Float16 *)dst;
        for (int i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

typedef struct {
    const char *k_base, *v_base;
    int64_t block_stride, token_stride; /* bytes */
    int num_heads, num_kv_heads, head_dim, block_size, dt;
    size_t elem;
} Layout;

#include "vec_exp.h" /* EXP_*: the exp scheme of exp8/exp16 */

#ifdef PD_AVX2
#include "cpu_decode_attention_avx2.h"
#endif

/* A call's work items: partition p of request b is item first[b] + p, item_req[item] == b. */
typedef struct {
    const int64_t *first;
    const int32_t *item_req, *seq_lens, *block_tables;
    const int64_t *order; /* the items, full partitions first (run_items512 takes them in this order) */
    int64_t items, table_stride, q_stride; /* q_stride in elements */
    const void *query;
    float scale;
    float *partial; /* per item: m[H], l[H], acc[H * D] */
    size_t item_floats;
} Items;

/* Item `it`'s request and keys [t0, t1). */
static inline void item_range(const Items *w, int64_t it, int *b, int *t0, int *t1) {
    *b = w->item_req[it];
    *t0 = (int)(it - w->first[*b]) * PART_TOKENS;
    *t1 = *t0 + PART_TOKENS < w->seq_lens[*b] ? *t0 + PART_TOKENS : w->seq_lens[*b];
}

#ifdef PD_AVX512
#include "cpu_decode_attention_avx512.h"
#endif

/* scores[h][col0 + i] = q[h] . k[off0 + i][h / group] for n tokens of the block at `blk`. */
static void block_scores(const Layout *L, const float *q, const char *blk, int off0, int n, float *scores,
                         int col0, float *row) {
    const int KVH = L->num_kv_heads, D = L->head_dim, group = L->num_heads / KVH;
#ifdef PD_AVX2
    if (D % 8 == 0) {
        switch (group) {
            case 1: scores_g1(L, q, blk, off0, n, scores, col0); return;
            case 2: scores_g2(L, q, blk, off0, n, scores, col0); return;
            case 4: scores_g4(L, q, blk, off0, n, scores, col0); return;
            case 8: scores_g8(L, q, blk, off0, n, scores, col0); return;
            default: break;
        }
    }
#endif
    for (int i = 0; i < n; i++) {
        load_row(row, blk + (int64_t)(off0 + i) * L->token_stride, KVH * D, L->dt);
        for (int h = 0; h < L->num_heads; h++) {
            const float *qh = q + (size_t)h * D, *kh = row + (size_t)(h / group) * D;
            float s = 0.f;
            for (int d = 0; d < D; d++) s += qh[d] * kh[d];
            scores[(size_t)h * PART_TOKENS + col0 + i] = s;
        }
    }
}

/* acc[h] += p[h][col0 + i] * v[off0 + i][h / group] over n tokens of the block at `blk`. */
static void block_values(const Layout *L, const float *p, const char *blk, int off0, int n, float *acc, int col0,
                         float *row) {
    const int KVH = L->num_kv_heads, D = L->head_dim, group = L->num_heads / KVH;
#ifdef PD_AVX2
    if (D % 8 == 0) {
        switch (group) {
            case 1: values_g1(L, p, blk, off0, n, acc, col0); return;
            case 2: values_g2(L, p, blk, off0, n, acc, col0); return;
            case 4: values_g4(L, p, blk, off0, n, acc, col0); return;
            case 8: values_g8(L, p, blk, off0, n, acc, col0); return;
            default: break;
        }
    }
#endif
    for (int i = 0; i < n; i++) {
        load_row(row, blk + (int64_t)(off0 + i) * L->token_stride, KVH * D, L->dt);
        for (int h = 0; h < L->num_heads; h++) {
            const float w = p[(size_t)h * PART_TOKENS + col0 + i];
            const float *v = row + (size_t)(h / group) * D;
            float *a = acc + (size_t)h * D;
            for (int d = 0; d < D; d++) a[d] += w * v[d];
        }
    }
}

/* Ask for the next block's bytes while this one is computed: blocks are scattered, so the
 * hardware prefetchers cannot guess the next address. */
static inline void prefetch_block(const char *blk, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(blk + o, 0, 3);
}

/* One work item: query rows `q` (fp32, pre-scaled, [num_heads][head_dim]) against keys
 * [t0, t1) of the request whose block table is `table`. Writes the partition's per-head max
 * `m`, exp-sum `l` and unnormalised value sum `acc` ([num_heads][head_dim]). */
static void attend_partition(const Layout *L, const float *q, const int32_t *table, int t0, int t1,
                             float *m, float *l, float *acc, float *scores /* [num_heads][PART_TOKENS] */,
                             float *row /* [num_kv_heads * head_dim] */) {
    const int H = L->num_heads, D = L->head_dim, bs = L->block_size;
    const int n = t1 - t0;
    const int last = (t1 - 1) / bs;
    prefetch_block(L->k_base + (int64_t)table[t0 / bs] * L->block_stride, L->block_stride);
    for (int t = t0; t < t1;) {
        const int off = t % bs, cnt = (bs - off < t1 - t) ? bs - off : t1 - t;
        if (t / bs < last) prefetch_block(L->k_base + (int64_t)table[t / bs + 1] * L->block_stride, L->block_stride);
        block_scores(L, q, L->k_base + (int64_t)table[t / bs] * L->block_stride, off, cnt, scores, t - t0, row);
        t += cnt;
    }
    for (int h = 0; h < H; h++) {
        float *sh = scores + (size_t)h * PART_TOKENS, mx = -INFINITY, sum = 0.f;
        for (int i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
        int i = 0;
#ifdef PD_AVX2
        __m256 vsum = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(sh + i, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        sum = hsum8(vsum);
#endif
        for (; i < n; i++) {
            sh[i] = expf(sh[i] - mx);
            sum += sh[i];
        }
        m[h] = mx;
        l[h] = sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)H * D);
    prefetch_block(L->v_base + (int64_t)table[t0 / bs] * L->block_stride, L->block_stride);
    for (int t = t0; t < t1;) {
        const int off = t % bs, cnt = (bs - off < t1 - t) ? bs - off : t1 - t;
        if (t / bs < last) prefetch_block(L->v_base + (int64_t)table[t / bs + 1] * L->block_stride, L->block_stride);
        block_values(L, scores, L->v_base + (int64_t)table[t / bs] * L->block_stride, off, cnt, acc, t - t0, row);
        t += cnt;
    }
}

/* out/query: [num_reqs, num_heads, head_dim], heads dense within a row (row strides q_stride,
 * out_stride in elements); row b is request b's one query token. kv_cache: [2, num_blocks,
 * block_size, num_kv_heads, head_dim] contiguous; block_tables: [num_reqs, table_stride] int32;
 * seq_lens[b]: request b's keys (its query is the last of them). Returns 0, or -1 when scratch
 * memory could not be allocated. */
int pd_paged_decode_attention(void *out, const void *query, const void *kv_cache, const int32_t *block_tables,
                              const int32_t *seq_lens, int num_reqs, int num_heads, int num_kv_heads, int head_dim,
                              int block_size, int64_t num_blocks, int64_t table_stride, int64_t q_stride,
                              int64_t out_stride, float scale, int dt, int num_threads) {
    const size_t elem = dt == DT_F32 ? 4 : 2;
    Layout L = {0};
    L.token_stride = (int64_t)num_kv_heads * head_dim * (int64_t)elem;
    L.block_stride = (int64_t)block_size * L.token_stride;
    L.k_base = (const char *)kv_cache;
    L.v_base = L.k_base + num_blocks * L.block_stride;
    L.num_heads = num_heads, L.num_kv_heads = num_kv_heads, L.head_dim = head_dim;
    L.block_size = block_size, L.dt = dt, L.elem = elem;
    const int H = num_heads, D = head_dim;

    /* Work items: partition p of request b is item first[b] + p. */
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)num_reqs + 1));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int b = 0; b < num_reqs; b++) {
        const int parts = seq_lens[b] > 0 ? (seq_lens[b] + PART_TOKENS - 1) / PART_TOKENS : 0;
        first[b + 1] = first[b] + parts;
    }
    const int64_t items = first[num_reqs];
    int32_t *item_req = malloc(sizeof(int32_t) * (size_t)(items > 0 ? items : 1));
    /* Per item: m[H], l[H], acc[H*D]. */
    const size_t item_floats = (size_t)H * (2 + (size_t)D);
    float *partial = malloc(sizeof(float) * item_floats * (size_t)(items > 0 ? items : 1));
    if (item_req == NULL || partial == NULL) {
        free(partial), free(item_req), free(first);
        return -1;
    }
    for (int b = 0; b < num_reqs; b++)
        for (int64_t it = first[b]; it < first[b + 1]; it++) item_req[it] = b;
    /* Short partitions (each request's last) last: the threads then finish a call close together. */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(items > 0 ? items : 1)), n_ordered = 0;
    if (order == NULL) {
        free(partial), free(item_req), free(first);
        return -1;
    }
    for (int pass = 0; pass < 2; pass++)
        for (int64_t it = 0; it < items; it++) {
            const int b = item_req[it];
            const int full = (it - first[b] + 1) * PART_TOKENS <= seq_lens[b];
            if (full == (pass == 0)) order[n_ordered++] = it;
        }
    int failed = 0;
    /* A parallel region costs a few microseconds (more when the cores are busy elsewhere): small
     * steps run on the calling thread, and no step uses more threads than it has items. */
    int64_t total_keys = 0;
    for (int b = 0; b < num_reqs; b++) total_keys += seq_lens[b];
    int threads = total_keys * H < SERIAL_WORK ? 1 : num_threads;
    if (threads > items) threads = (int)(items > 0 ? items : 1);

    const Items w = {.first = first, .item_req = item_req, .seq_lens = seq_lens, .block_tables = block_tables,
                     .order = order, .items = items, .table_stride = table_stride, .q_stride = q_stride,
                     .query = query, .scale = scale, .partial = partial, .item_floats = item_floats};
#ifdef PD_AVX512
    int64_t counter = 0; /* the next unclaimed item (run_items512) */
    const int use512 = dt == DT_BF16;
#else
    const int use512 = 0;
#endif

#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *q = malloc(sizeof(float) * (size_t)H * D);
        float *scores = malloc(sizeof(float) * (size_t)H * PART_TOKENS);
        float *row = malloc(sizeof(float) * ((size_t)num_kv_heads * D + (size_t)D));
        int loaded = -1;
        const int ok = q != NULL && scores != NULL && row != NULL;
        if (!ok) failed = 1;
        if (use512) {
#ifdef PD_AVX512
            if (!ok || run_items512(&L, &w, &counter, scores) != 0) failed = 1;
#endif
#pragma omp barrier
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; item++) {
                if (!ok) continue;
                int b, t0, t1;
                item_range(&w, item, &b, &t0, &t1);
                if (loaded != b) {
                    load_row(q, (const char *)query + (size_t)b * q_stride * elem, H * D, dt);
                    for (int i = 0; i < H * D; i++) q[i] *= scale;
                    loaded = b;
                }
                float *m = partial + (size_t)item * item_floats, *l = m + H, *acc = l + H;
                attend_partition(&L, q, block_tables + (size_t)b * table_stride, t0, t1, m, l, acc, scores, row);
            }
        }
        /* Merge each request's partitions (the implicit barrier above made them all visible). */
#pragma omp for schedule(static)
        for (int b = 0; b < num_reqs; b++) {
            if (!ok) continue;
            float *res = row;  /* D floats of scratch */
            char *op = (char *)out + (size_t)b * out_stride * elem;
            for (int h = 0; h < H; h++) {
                float mx = -INFINITY, total = 0.f;
                for (int64_t it = first[b]; it < first[b + 1]; it++) {
                    const float mh = partial[(size_t)it * item_floats + h];
                    mx = mh > mx ? mh : mx;
                }
                memset(res, 0, sizeof(float) * (size_t)D);
                for (int64_t it = first[b]; it < first[b + 1]; it++) {
                    const float *m = partial + (size_t)it * item_floats, *l = m + H, *acc = l + H;
                    const float w = expf(m[h] - mx);
                    total += w * l[h];
                    for (int d = 0; d < D; d++) res[d] += w * acc[(size_t)h * D + d];
                }
                const float inv = total > 0.f ? 1.f / total : 0.f;
                for (int d = 0; d < D; d++) res[d] *= inv;
#ifdef PD_AVX512
                if (dt == DT_BF16) {
                    store_bf16_512((uint16_t *)(op + (size_t)h * D * elem), res, D);
                    continue;
                }
#endif
                store_row(op + (size_t)h * D * elem, res, D, dt);
            }
        }
        free(q);
        free(scores);
        free(row);
    }
    free(partial);
    free(order);
    free(item_req);
    free(first);
    return failed ? -1 : 0;
}

/* The vector path this build takes for bf16 caches: 0 plain C, 1 AVX2, 2 AVX-512, 3 AVX-512 with
 * vdpbf16ps. Tests build the source with lower ISA flags and check each build takes the path meant. */
int pd_decode_attention_isa(void) {
#if defined(PD_AVX512) && defined(__AVX512BF16__)
    return 3;
#elif defined(PD_AVX512)
    return 2;
#elif defined(PD_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* The cache write of a step's new tokens: key/value row t (kv_heads * head_dim elements of `elem`
 * bytes, rows k_stride/v_stride elements apart) into slot slot_mapping[t] of the K and V halves;
 * slots < 0 are skipped (tokens whose KV is not kept). One call per layer replaces the torch
 * reference's mask test, two index conversions and two index_copy_ calls. -1: a slot past the cache. */
int pd_write_kv_cache(void *kv_cache, const void *key, const void *value, const int64_t *slot_mapping,
                      int64_t num_tokens, int64_t k_stride, int64_t v_stride, int64_t row_elems, int64_t num_slots,
                      int elem) {
    const size_t row = (size_t)row_elems * elem;
    char *k_cache = kv_cache, *v_cache = (char *)kv_cache + (size_t)num_slots * row;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] >= num_slots)
            return -1;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slot_mapping[t];
        if (s < 0)
            continue;
        memcpy(k_cache + (size_t)s * row, (const char *)key + (size_t)(t * k_stride) * elem, row);
        memcpy(v_cache + (size_t)s * row, (const char *)value + (size_t)(t * v_stride) * elem, row);
    }
    return 0;
}
