/* exp(x) for the compiled CPU kernels: one scheme, one set of constants.
 *
 * exp(x) = 2^n exp(r), x = n ln2 + r with |r| <= ln2/2: ln2 split in two for an exact r, exp(r) by a
 * degree-6 polynomial (relative error about 2e-7, like expf's). cpu_decode_attention's exp8/exp16
 * write it in AVX2/AVX-512 intrinsics; pd_expf below is the plain-C form that compilers vectorize.
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
#endif
