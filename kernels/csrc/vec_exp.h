/* exp(x) for the compiled CPU kernels: one scheme, one set of constants.
 *
 * exp(x) = 2^n exp(r), x = n ln2 + r with |r| <= ln2/2: ln2 split in two for an exact r, exp(r) by a
 * degree-6 polynomial (relative error about 2e-7, like expf's). pd_expf is the plain-C form that
 * compilers vectorize; exp8/exp16 the AVX2/AVX-512 forms (defined where the build has those).
 */
#ifndef PD_VEC_EXP_H
#define PD_VEC_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXP_MIN_X -87.3f /* below: ~0 (2^n would leave the normal range) */
#define EXP_MAX_X 88.0f  /* above: clamped (exp(88) = 1.65e38, still finite) */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P6 1.9875691500e-4f
#define EXP_P5 1.3981999507e-3f
#define EXP_P4 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P2 1.6666665459e-1f
#define EXP_P1 5.0000001201e-1f

/* Branch-free so that a loop calling it vectorizes (fmaf is one instruction with -march=native). */
static inline float pd_expf(float x) {
    x = x < EXP_MIN_X ? EXP_MIN_X : x > EXP_MAX_X ? EXP_MAX_X : x;
    const float n = rintf(x * EXP_LOG2E);
    float r = fmaf(-n, EXP_LN2_HI, x);
    r = fmaf(-n, EXP_LN2_LO, r);
    float p = EXP_P6;
    p = fmaf(p, r, EXP_P5);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r * r, r + 1.f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) for 8 floats (the scheme above), 2^n built in the exponent bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN_X));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P6);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) for 16 floats (the scheme above), 2^n applied by vscalefps. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN_X));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
