/* AVX-512 bodies of kernels/csrc/cpu_decode_attention.c for bf16 caches (included by it when the
 * build has AVX-512F/BW; see its header for the work split). Same work item as the AVX2 path
 * (scores, softmax, weighted values of up to PART_TOKENS keys), with less work per byte, because
 * the AVX2 path is compute-bound (it scales with threads far below memory bandwidth):
 *  - a head row is read in chunks of 32 bf16 (one zmm; masked loads for a head_dim tail, so any
 *    head_dim works). Scores use vdpbf16ps on the bf16 query and key (products of two bf16 are
 *    exact in fp32, sums are fp32), and the softmax scale is applied to the fp32 scores, so the
 *    query is never rounded. Without avx512_bf16 the same chunk is widened and FMA'd in fp32.
 *  - widening a bf16 chunk costs one shift (even elements) and one AND (odd elements), no
 *    shuffles: value accumulators are kept in that even/odd order and put back in order once
 *    per work item (unpermute_acc). Probabilities and values stay fp32.
 *  - within a block, kv head by kv head: the value accumulators of a kv head's query heads stay
 *    in registers for all the block's tokens (loaded and stored once per block, not per token),
 *    and 16 (token, head) dot products are reduced to 16 scores with one shuffle tree.
 *  - blocks are scattered, so the hardware prefetchers cannot follow: each block's processing
 *    also prefetches, spread over its kv heads, the block PF_BLOCKS ahead in the item's stream
 *    (its keys, then its values).
 */
#ifndef PF_BLOCKS
#define PF_BLOCKS 2
#endif
#ifndef PF_HINT
#define PF_HINT 1
#endif
#define CHUNK 32 /* bf16 per zmm; per head, the q and accumulator slots are CHUNK floats per chunk */

static inline int nchunks(int D) { return (D + CHUNK - 1) / CHUNK; }
static inline __mmask32 chunk_mask(int D, int c) {
    const int left = D - c * CHUNK;
    return left >= CHUNK ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
}
static inline __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Query heads in the form the score loop reads: per head and chunk a 32-float slot holding the 32
 * bf16 values (zero-padded; vdpbf16ps) or, without avx512_bf16, their even and odd elements as fp32. */
static void q512_prepare(float *dst, const uint16_t *q, int H, int D) {
    const int NC = nchunks(D);
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) {
            const __m512i x = _mm512_maskz_loadu_epi16(chunk_mask(D, c), q + (size_t)h * D + c * CHUNK);
            float *s = dst + ((size_t)h * NC + c) * CHUNK;
#ifdef __AVX512BF16__
            _mm512_store_si512((void *)s, x);
#else
            _mm512_store_ps(s, bf16_even(x));
            _mm512_store_ps(s + 16, bf16_odd(x));
#endif
        }
}

/* r[j] = sum of the lanes of a[j]: in-lane pair sums twice, then 128-bit lane sums twice. */
static inline __m512 hsum16x16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xdd));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* Scores of n tokens (k0: the first one's row of this kv head) against GT query heads, T tokens
 * at a time (T * GT == 16 dot products, one reduction). A short last tile repeats the last token
 * and drops its results. */
static inline __attribute__((always_inline)) void qk_tile(const char *k0, int64_t ts, int n, const float *q,
                                                          int NC, __mmask32 tail, float scale, float *scores,
                                                          const int T, const int GT) {
    for (int i = 0; i < n; i += T) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        for (int c = 0; c < NC; c++) {
            const __mmask32 m = c == NC - 1 ? tail : ~(__mmask32)0;
            for (int t = 0; t < T; t++) {
                const int tok = i + t < n ? i + t : n - 1;
                const __m512i k = _mm512_maskz_loadu_epi16(m, k0 + tok * ts + c * 64);
#ifdef __AVX512BF16__
                for (int g = 0; g < GT; g++) {
                    const __m512i qs = _mm512_load_si512((const void *)(q + ((size_t)g * NC + c) * CHUNK));
                    acc[g * T + t] = _mm512_dpbf16_ps(acc[g * T + t], (__m512bh)qs, (__m512bh)k);
                }
#else
                const __m512 ke = bf16_even(k), ko = bf16_odd(k);
                for (int g = 0; g < GT; g++) {
                    const float *qs = q + ((size_t)g * NC + c) * CHUNK;
                    acc[g * T + t] = _mm512_fmadd_ps(_mm512_load_ps(qs), ke,
                                                     _mm512_fmadd_ps(_mm512_load_ps(qs + 16), ko, acc[g * T + t]));
                }
#endif
            }
        }
        const __m512 s = _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
        const int cnt = n - i < T ? n - i : T;
        const __mmask16 keep = (__mmask16)((1u << cnt) - 1);
        for (int g = 0; g < GT; g++) { /* lanes [g * T, g * T + cnt) to the head's row */
            const __m512i from = _mm512_add_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(g * T));
            _mm512_mask_storeu_ps(scores + (size_t)g * PART_TOKENS + i, keep, _mm512_permutexvar_ps(from, s));
        }
    }
}

/* acc[g] += p[g][t] * v[t] over n tokens (v0: the first one's row of this kv head, at chunk c0) for
 * HG <= 4 query heads and CC <= 2 chunks. The accumulators are named variables, not an array: GCC
 * keeps an array in memory and stores it at every token (measured: half the speed). */
#define PV_EACH(X) X(0, 0) X(1, 0) X(2, 0) X(3, 0) X(0, 1) X(1, 1) X(2, 1) X(3, 1)
#define PV_ACC(g, c) (acc + (size_t)(g) * astride + (c) * CHUNK)
static inline __attribute__((always_inline)) void pv_tile(const char *v0, int64_t ts, int n, const float *p,
                                                          float *acc, int astride, const __mmask32 *m, const int HG,
                                                          const int CC) {
#define PV_DECL(g, c)                                                                                         \
    __m512 a##g##c##e = _mm512_setzero_ps(), a##g##c##o = a##g##c##e;                                        \
    if (g < HG && c < CC) a##g##c##e = _mm512_load_ps(PV_ACC(g, c)), a##g##c##o = _mm512_load_ps(PV_ACC(g, c) + 16);
    PV_EACH(PV_DECL)
    for (int t = 0; t < n; t++) {
        const __m512 w0 = _mm512_set1_ps(p[t]);
        const __m512 w1 = HG > 1 ? _mm512_set1_ps(p[PART_TOKENS + t]) : w0;
        const __m512 w2 = HG > 2 ? _mm512_set1_ps(p[2 * PART_TOKENS + t]) : w0;
        const __m512 w3 = HG > 3 ? _mm512_set1_ps(p[3 * PART_TOKENS + t]) : w0;
        const __m512i x0 = _mm512_maskz_loadu_epi16(m[0], v0 + t * ts);
        const __m512 x0e = bf16_even(x0), x0o = bf16_odd(x0);
        const __m512i x1 = CC > 1 ? _mm512_maskz_loadu_epi16(m[1], v0 + t * ts + 64) : x0;
        const __m512 x1e = bf16_even(x1), x1o = bf16_odd(x1);
#define PV_FMA(g, c)                                                                                          \
    if (g < HG && c < CC)                                                                                     \
        a##g##c##e = _mm512_fmadd_ps(w##g, x##c##e, a##g##c##e),                                              \
        a##g##c##o = _mm512_fmadd_ps(w##g, x##c##o, a##g##c##o);
        PV_EACH(PV_FMA)
    }
#define PV_STORE(g, c) \
    if (g < HG && c < CC) _mm512_store_ps(PV_ACC(g, c), a##g##c##e), _mm512_store_ps(PV_ACC(g, c) + 16, a##g##c##o);
    PV_EACH(PV_STORE)
}

#define QK_VARIANT(T, GT)                                                                                      \
    static void qk_##T##x##GT(const char *k0, int64_t ts, int n, const float *q, int NC, __mmask32 tail,     \
                              float scale, float *scores) {                                                  \
        qk_tile(k0, ts, n, q, NC, tail, scale, scores, T, GT);                                               \
    }
QK_VARIANT(16, 1)
QK_VARIANT(8, 2)
QK_VARIANT(4, 4)
#define PV_VARIANT(HG, CC)                                                                                     \
    static void pv_##HG##x##CC(const char *v0, int64_t ts, int n, const float *p, float *acc, int astride,    \
                               const __mmask32 *m) {                                                         \
        pv_tile(v0, ts, n, p, acc, astride, m, HG, CC);                                                      \
    }
PV_VARIANT(1, 1)
PV_VARIANT(1, 2)
PV_VARIANT(2, 1)
PV_VARIANT(2, 2)
PV_VARIANT(4, 1)
PV_VARIANT(4, 2)

/* Largest of 4, 2, 1 dividing the group: query heads handled together. */
static inline int head_tile(int G) { return G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1; }

/* Prefetch part `part` of `parts` of the block at `pf` (NULL: nothing). */
static inline void prefetch_part(const char *pf, int64_t bytes, int part, int parts) {
    if (pf == NULL) return;
    const int64_t lines = (bytes + 63) / 64, per = (lines + parts - 1) / parts;
    const int64_t end = (part + 1) * per < lines ? (part + 1) * per : lines;
    for (int64_t i = part * per; i < end; i++) __builtin_prefetch(pf + i * 64, 0, PF_HINT);
}

static void block_qk512(const Layout *L, const float *q, const char *blk, int off0, int n, float *scores, int col0,
                        float scale, const char *pf) {
    const int KVH = L->num_kv_heads, D = L->head_dim, G = L->num_heads / KVH, NC = nchunks(D), GT = head_tile(G);
    const __mmask32 tail = chunk_mask(D, NC - 1);
    const int64_t ts = L->token_stride;
    for (int kh = 0; kh < KVH; kh++) {
        prefetch_part(pf, L->block_stride, kh, KVH);
        const char *k0 = blk + (int64_t)off0 * ts + (size_t)kh * D * 2;
        for (int h0 = 0; h0 < G; h0 += GT) {
            const int h = kh * G + h0;
            const float *qh = q + (size_t)h * NC * CHUNK;
            float *sh = scores + (size_t)h * PART_TOKENS + col0;
            if (GT == 4) qk_4x4(k0, ts, n, qh, NC, tail, scale, sh);
            else if (GT == 2) qk_8x2(k0, ts, n, qh, NC, tail, scale, sh);
            else qk_16x1(k0, ts, n, qh, NC, tail, scale, sh);
        }
    }
}

static void block_pv512(const Layout *L, const float *p, const char *blk, int off0, int n, float *acc, int col0,
                        const char *pf) {
    const int KVH = L->num_kv_heads, D = L->head_dim, G = L->num_heads / KVH, NC = nchunks(D), HG = head_tile(G);
    const int64_t ts = L->token_stride;
    const int astride = NC * CHUNK;
    for (int kh = 0; kh < KVH; kh++) {
        prefetch_part(pf, L->block_stride, kh, KVH);
        const char *v0 = blk + (int64_t)off0 * ts + (size_t)kh * D * 2;
        for (int h0 = 0; h0 < G; h0 += HG) {
            const int h = kh * G + h0;
            const float *ph = p + (size_t)h * PART_TOKENS + col0;
            for (int c0 = 0; c0 < NC; c0 += 2) {
                const int CC = NC - c0 >= 2 ? 2 : 1;
                const __mmask32 m[2] = {chunk_mask(D, c0), CC == 2 ? chunk_mask(D, c0 + 1) : 0};
                const char *vc = v0 + c0 * 64;
                float *ac = acc + (size_t)h * astride + c0 * CHUNK;
                void (*pv)(const char *, int64_t, int, const float *, float *, int, const __mmask32 *) =
                    HG == 4 ? (CC == 2 ? pv_4x2 : pv_4x1) : HG == 2 ? (CC == 2 ? pv_2x2 : pv_2x1)
                                                                  : (CC == 2 ? pv_1x2 : pv_1x1);
                pv(vc, ts, n, ph, ac, astride, m);
            }
        }
    }
}

/* scores[h][0, n) = exp(s - max), m[h] = max, l[h] = sum. */
static void softmax512(float *scores, int H, int n, float *m, float *l) {
    for (int h = 0; h < H; h++) {
        float *sh = scores + (size_t)h * PART_TOKENS;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, k, sh + i));
        }
        const float mh = _mm512_reduce_max_ps(mx);
        for (int i = 0; i < n; i += 16) {
            const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + i), _mm512_set1_ps(mh)));
            _mm512_mask_storeu_ps(sh + i, k, e);
            sum = _mm512_mask_add_ps(sum, k, sum, e);
        }
        m[h] = mh;
        l[h] = _mm512_reduce_add_ps(sum);
    }
}

/* out[h][0, D) = the accumulators of head h in element order (they are kept even/odd per chunk). */
static void unpermute_acc(const float *acc, float *out, int H, int D) {
    const int NC = nchunks(D);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int h = 0; h < H; h++)
        for (int c = 0; c < NC; c++) {
            const float *s = acc + ((size_t)h * NC + c) * CHUNK;
            const __m512 e = _mm512_load_ps(s), o = _mm512_load_ps(s + 16);
            const int left = D - c * CHUNK;
            float *d = out + (size_t)h * D + c * CHUNK;
            const __mmask16 k0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 k1 = left >= 32 ? (__mmask16)0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            _mm512_mask_storeu_ps(d, k0, _mm512_permutex2var_ps(e, lo, o));
            _mm512_mask_storeu_ps(d + 16, k1, _mm512_permutex2var_ps(e, hi, o));
        }
}

/* f32_to_bf16 (cpu_decode_attention.c) of n floats, 16 at a time: the merge's output rows. */
static void store_bf16_512(uint16_t *dst, const float *src, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(k, src + i));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                      _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16(dst + i, k, _mm512_cvtepi32_epi16(r));
    }
}

/* attend_partition (cpu_decode_attention.c) for bf16 caches: q from q512_prepare (unscaled),
 * acc512: [num_heads][nchunks * CHUNK] 64-byte aligned scratch. The item's stream of blocks is its
 * key blocks, its value blocks, then `next` (the next item's first key blocks, NULL-padded):
 * block s prefetches block s + PF_BLOCKS, so the first PF_BLOCKS of the stream were prefetched by
 * the previous item unless `cold`. */
static void attend_partition512(const Layout *L, const float *q, float scale, const int32_t *table, int t0, int t1,
                                float *m, float *l, float *acc, float *scores, float *acc512,
                                const char *const next[PF_BLOCKS], int cold) {
    const int H = L->num_heads, D = L->head_dim, bs = L->block_size;
    const int first = t0 / bs, nb = (t1 - 1) / bs - first + 1;
#define STREAM(s) ((s) < nb ? L->k_base + (int64_t)table[first + (s)] * L->block_stride               \
                   : (s) < 2 * nb ? L->v_base + (int64_t)table[first + (s) - nb] * L->block_stride \
                                  : next[(s) - 2 * nb])
    if (cold)
        for (int s = 0; s < PF_BLOCKS; s++) prefetch_part(STREAM(s), L->block_stride, 0, 1);
    for (int t = t0, s = 0; t < t1; s++) {
        const int off = t % bs, cnt = (bs - off < t1 - t) ? bs - off : t1 - t;
        block_qk512(L, q, L->k_base + (int64_t)table[t / bs] * L->block_stride, off, cnt, scores, t - t0, scale,
                    STREAM(s + PF_BLOCKS));
        t += cnt;
    }
    softmax512(scores, H, t1 - t0, m, l);
    memset(acc512, 0, sizeof(float) * (size_t)H * nchunks(D) * CHUNK);
    for (int t = t0, s = nb; t < t1; s++) {
        const int off = t % bs, cnt = (bs - off < t1 - t) ? bs - off : t1 - t;
        block_pv512(L, scores, L->v_base + (int64_t)table[t / bs] * L->block_stride, off, cnt, acc512, t - t0,
                    STREAM(s + PF_BLOCKS));
        t += cnt;
    }
#undef STREAM
    unpermute_acc(acc512, acc, H, D);
}

/* This thread's share of the work items (see pd_paged_decode_attention), taken from the shared
 * counter one ahead, so that each item's last blocks prefetch the next one's first (with
 * `omp for schedule(dynamic)` a thread learns its next item only when it starts it, and would
 * wait for that item's first blocks). Returns 0, or -1 when scratch could not be allocated. */
static int run_items512(const Layout *L, const Items *w, int64_t *counter, float *scores) {
    const int H = L->num_heads, D = L->head_dim, bs = L->block_size;
    const size_t bytes = sizeof(float) * (size_t)H * nchunks(D) * CHUNK; /* a multiple of 64 */
    float *q = aligned_alloc(64, bytes), *acc512 = aligned_alloc(64, bytes);
    int64_t cur = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    if (q == NULL || acc512 == NULL) cur = w->items;
    int loaded = -1, cold = 1;
    while (cur < w->items) {
        const int64_t nxt = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
        const char *next[PF_BLOCKS] = {0};
        if (nxt < w->items) {
            int b, t0, t1;
            item_range(w, w->order[nxt], &b, &t0, &t1);
            const int32_t *tb = w->block_tables + (size_t)b * w->table_stride;
            for (int s = 0; s < PF_BLOCKS && t0 / bs + s <= (t1 - 1) / bs; s++)
                next[s] = L->k_base + (int64_t)tb[t0 / bs + s] * L->block_stride;
        }
        int b, t0, t1;
        const int64_t item = w->order[cur];
        item_range(w, item, &b, &t0, &t1);
        if (loaded != b) q512_prepare(q, (const uint16_t *)w->query + (size_t)b * w->q_stride, H, D), loaded = b;
        float *m = w->partial + (size_t)item * w->item_floats, *l = m + H, *acc = l + H;
        attend_partition512(L, q, w->scale, w->block_tables + (size_t)b * w->table_stride, t0, t1, m, l, acc, scores,
                            acc512, next, cold);
        cold = 0;
        cur = nxt;
    }
    const int ok = q != NULL && acc512 != NULL;
    free(q);
    free(acc512);
    return ok ? 0 : -1;
}
