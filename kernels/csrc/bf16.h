/* bf16 <-> fp32 for the compiled CPU kernels: one definition of torch's rounding. */
#ifndef PD_BF16_H
#define PD_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN kept quiet: c10::BFloat16's conversion. Branch-free, so loops vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40) : rounded;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* f32_to_bf16 for 16 lanes in integer operations: the rounding on CPUs without vcvtneps2bf16, and for the
 * denormals that instruction reads as zero. */
static inline __m256i bf16x16_round_int(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PD_BF16X16 1
/* The two conversions above for 16 lanes. vcvtneps2bf16 rounds to nearest even and quiets NaN as
 * f32_to_bf16 does, but reads fp32 denormals as zero: vectors holding one take the integer path. */
static inline __m256i bf16x16_from_f32(__m512 v) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) /* 0x20: denormal */
        return bf16x16_round_int(v);
    return (__m256i)_mm512_cvtneps_pbh(v);
}
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 bf16x16_load(const uint16_t *p) { return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)p)); }
static inline void bf16x16_store(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, bf16x16_from_f32(v)); }
/* round_dt for bf16: the fp32 value torch would store. */
static inline __m512 bf16x16_round(__m512 v) { return bf16x16_to_f32(bf16x16_from_f32(v)); }
#endif
#endif
