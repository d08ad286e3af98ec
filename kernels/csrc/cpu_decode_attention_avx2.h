/* The AVX2+FMA+F16C bodies of kernels/csrc/cpu_decode_attention.c (included there when the build has
 * those instructions): 8-lane loads of any cache dtype, horizontal sums, exp, and the score and value
 * loops per GQA group size. Every dtype on AVX2-only CPUs, and fp32/fp16 caches on AVX-512 ones. */

static inline __m256 load8(const char *p, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p);
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight sums in one vector: out[j] = sum of the lanes of a[j]. Seven shuffles+adds instead of
 * eight separate horizontal sums. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 r0 = _mm256_hadd_ps(a[0], a[1]), r1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 r2 = _mm256_hadd_ps(a[4], a[5]), r3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0 = _mm256_hadd_ps(r0, r1), s1 = _mm256_hadd_ps(r2, r3);
    /* s0 = [a0 a1 a2 a3 | a0 a1 a2 a3] (low | high lane partial sums), s1 likewise for a4..a7. */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* The vector bodies exist once per group size G (query heads per kv head), so the accumulators
 * are fixed-size arrays the compiler keeps in registers. Both walk a block token by token, all
 * kv heads of a token before the next token: the block's bytes are read in address order, a
 * stream the hardware prefetchers follow (head by head over all tokens would jump 1 KB at every
 * step and stall on memory; measured 1.5x slower single-threaded on the bench model's shape).
 *  - scores: T = 8/G keys at a time against the G query heads of their kv head: eight
 *    independent FMA chains (an FMA's result is ready only a few cycles after it issues), reduced
 *    with one shuffle tree (hsum8x8);
 *  - values: two keys at a time, added into the [heads][head_dim] accumulators, which stay in L1. */
#define DEFINE_VECTOR_BODIES(G)                                                                              \
    enum { T_##G = 8 / G };                                                                                      \
    static void scores_g##G(const Layout *L, const float *q, const char *blk, int off0, int n, float *scores,     \
                            int col0) {                                                                          \
        const int KVH = L->num_kv_heads, D = L->head_dim;                                                        \
        const char *k0 = blk + (int64_t)off0 * L->token_stride;                                                  \
        int i = 0;                                                                                               \
        for (; i + T_##G <= n; i += T_##G) {                                                                     \
            for (int kh = 0; kh < KVH; kh++) {                                                                   \
                const float *qk = q + (size_t)kh * G * D;                                                        \
                float *sk = scores + (size_t)kh * G * PART_TOKENS + col0;                                        \
                const char *kk = k0 + (size_t)kh * D * L->elem;                                                  \
                __m256 acc[8];                                                                                   \
                for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();                                        \
                for (int d = 0; d < D; d += 8) {                                                                 \
                    for (int t = 0; t < T_##G; t++) {                                                            \
                        const __m256 kv = load8(kk + (int64_t)(i + t) * L->token_stride + (size_t)d * L->elem,   \
                                                L->dt);                                                          \
                        for (int g = 0; g < G; g++)                                                              \
                            acc[t * G + g] = _mm256_fmadd_ps(_mm256_loadu_ps(qk + (size_t)g * D + d), kv,        \
                                                             acc[t * G + g]);                                    \
                    }                                                                                            \
                }                                                                                                \
                float sums[8];                                                                                   \
                _mm256_storeu_ps(sums, hsum8x8(acc));                                                            \
                for (int t = 0; t < T_##G; t++)                                                                  \
                    for (int g = 0; g < G; g++) sk[(size_t)g * PART_TOKENS + i + t] = sums[t * G + g];          \
            }                                                                                                    \
        }                                                                                                        \
        for (; i < n; i++) {                                                                                     \
            for (int kh = 0; kh < KVH; kh++) {                                                                   \
                const float *qk = q + (size_t)kh * G * D;                                                        \
                float *sk = scores + (size_t)kh * G * PART_TOKENS + col0;                                        \
                const char *k = k0 + (int64_t)i * L->token_stride + (size_t)kh * D * L->elem;                    \
                __m256 acc[G];                                                                                   \
                for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();                                        \
                for (int d = 0; d < D; d += 8) {                                                                 \
                    const __m256 kv = load8(k + (size_t)d * L->elem, L->dt);                                     \
                    for (int g = 0; g < G; g++)                                                                  \
                        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qk + (size_t)g * D + d), kv, acc[g]);           \
                }                                                                                                \
                for (int g = 0; g < G; g++) sk[(size_t)g * PART_TOKENS + i] = hsum8(acc[g]);                     \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
    static void values_g##G(const Layout *L, const float *p, const char *blk, int off0, int n, float *acc,       \
                            int col0) {                                                                          \
        const int KVH = L->num_kv_heads, D = L->head_dim;                                                        \
        const char *v0 = blk + (int64_t)off0 * L->token_stride;                                                  \
        int i = 0;                                                                                               \
        for (; i + 2 <= n; i += 2) {                                                                             \
            const char *va = v0 + (int64_t)i * L->token_stride, *vb = va + L->token_stride;                      \
            for (int kh = 0; kh < KVH; kh++) {                                                                   \
                __m256 pa[G], pb[G];                                                                             \
                for (int g = 0; g < G; g++) {                                                                    \
                    pa[g] = _mm256_broadcast_ss(p + (size_t)(kh * G + g) * PART_TOKENS + col0 + i);              \
                    pb[g] = _mm256_broadcast_ss(p + (size_t)(kh * G + g) * PART_TOKENS + col0 + i + 1);          \
                }                                                                                                \
                float *ak = acc + (size_t)kh * G * D;                                                            \
                for (int d = 0; d < D; d += 8) {                                                                 \
                    const __m256 x = load8(va + (size_t)(kh * D + d) * L->elem, L->dt);                          \
                    const __m256 y = load8(vb + (size_t)(kh * D + d) * L->elem, L->dt);                          \
                    for (int g = 0; g < G; g++) {                                                                \
                        float *a = ak + (size_t)g * D + d;                                                       \
                        _mm256_storeu_ps(a, _mm256_fmadd_ps(pb[g], y,                                            \
                                                            _mm256_fmadd_ps(pa[g], x, _mm256_loadu_ps(a))));     \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (; i < n; i++) {                                                                                     \
            const char *va = v0 + (int64_t)i * L->token_stride;                                                  \
            for (int kh = 0; kh < KVH; kh++) {                                                                   \
                float *ak = acc + (size_t)kh * G * D;                                                            \
                for (int d = 0; d < D; d += 8) {                                                                 \
                    const __m256 x = load8(va + (size_t)(kh * D + d) * L->elem, L->dt);                          \
                    for (int g = 0; g < G; g++) {                                                                \
                        float *a = ak + (size_t)g * D + d;                                                       \
                        const __m256 w = _mm256_broadcast_ss(p + (size_t)(kh * G + g) * PART_TOKENS + col0 + i); \
                        _mm256_storeu_ps(a, _mm256_fmadd_ps(w, x, _mm256_loadu_ps(a)));                          \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }
DEFINE_VECTOR_BODIES(1)
DEFINE_VECTOR_BODIES(2)
DEFINE_VECTOR_BODIES(4)
DEFINE_VECTOR_BODIES(8)
