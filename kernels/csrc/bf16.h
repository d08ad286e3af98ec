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
#endif
