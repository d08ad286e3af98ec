/* The elementwise steps of a Llama block on CPU, each one pass over its rows instead of 4-9 torch ops.
 *
 * At decode batch sizes each torch op touches a few KiB, so a step's ~25 norm/RoPE/SiLU ops per
 * layer cost their dispatch, allocations and bf16<->fp32 copies, not their arithmetic
 * (benchmarks/decode_step.py's "rest"). Here every step keeps the values in fp32 registers between
 * the points where torch rounds them to the model's dtype, and rounds exactly there, the same way
 * (round to nearest even), so each output equals the torch reference (engine/models/block_ops.py)
 * bit for bit, with two stated exceptions:
 *   - RMSNorm's sum of squares is added in this loop's order, not torch's (one fp32 rounding of
 *     the mean may differ; the products, the rsqrt and every later rounding are torch's);
 *   - SiLU's exp is vec_exp.h's polynomial, not torch's vector exp (both within ~1 ulp of exp).
 * Built with the flags below (after common/native_build.py's FLAGS, which they override): no a*b+c
 * may become one fused multiply-add with a single rounding where torch rounds twice, no product of
 * three may be regrouped, and -0 stays -0.
 * PD_CFLAGS: -ffp-contract=off -fno-associative-math -fsigned-zeros
 *
 * dt: 0 float32, 1 bfloat16 (kernels/cpu_block_ops.py checks dtypes, shapes and strides).
 * Rows run in parallel (OpenMP, torch's team) only when there are enough elements to pay for it.
 * bf16 rows on builds with AVX512_BF16 take 16-lane versions (the *_bf16x16 rows) of the same
 * arithmetic with the instruction's conversions (bf16.h): the same bits (tests/kernels/test_cpu_block_ops.py
 * compares them with a build without it), 1.3-1.9x faster at prefill sizes on a Zen 4.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec_exp.h"

/* Below: one thread (a fork/join costs more than the work). A decode step's rows (16 x 1024 for a norm,
 * 16 x 2816 for SiLU) take both cores: SiLU 33 -> 18 us, the norm 11 -> 7 us on the 2-core Zen 4. */
#define PAR_MIN_ELEMS (1 << 14)

/* The value torch would store for fp32 result v in a tensor of dtype dt, as fp32. */
static inline float round_dt(float v, int dt) { return dt ? bf16_to_f32(f32_to_bf16(v)) : v; }

#define LD(p, dt, i) ((dt) ? bf16_to_f32(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])

static inline void st(void *p, int dt, int64_t i, float v) {
    if (dt)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* Rows in parallel only when `par` (enough elements to pay for a fork/join). */
#define ROWS_FOR(rows) \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(par)") \
    for (int64_t r = 0; r < (rows); r++)

#define INLINE static inline __attribute__((always_inline))
#define LANES 16 /* partial sums of squares: a vector's worth, added lane-wise (no reassociation needed) */

/* One row; dt is a constant at each call site, so every loop is compiled for one dtype. */
INLINE void add_rms_norm_row(void *out, void *residual, const void *delta, const void *weight, int64_t base,
                             int64_t hidden, float eps, const int dt) {
    if (delta)
        for (int64_t i = 0; i < hidden; i++)
            st(residual, dt, base + i, LD(residual, dt, base + i) + LD(delta, dt, base + i));
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= hidden; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float x = LD(residual, dt, base + i + l);
            acc[l] += x * x;
        }
    for (; i < hidden; i++) {
        const float x = LD(residual, dt, base + i);
        acc[0] += x * x;
    }
    float ss = 0.f;
    for (int l = 0; l < LANES; l++)
        ss += acc[l];
    /* torch: mean = sum / n; + eps as fp32; rsqrt = 1 / sqrt, each rounded. */
    const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
    for (int64_t j = 0; j < hidden; j++)
        st(out, dt, base + j, LD(weight, dt, j) * round_dt(LD(residual, dt, base + j) * inv, dt));
}

#ifdef PD_BF16X16
/* add_rms_norm_row for bf16, 16 lanes at a time with native conversions (bf16.h): the same values in
 * the same order (lane l of `acc` is acc[l] above; the sum is stored, then squared), one pass fewer. */
static void add_rms_norm_row_bf16x16(uint16_t *out, uint16_t *res, const uint16_t *delta, const uint16_t *w,
                                     int64_t hidden, float eps) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + LANES <= hidden; i += LANES) {
        __m512 x = bf16x16_load(res + i);
        if (delta) {
            const __m256i sum = bf16x16_from_f32(_mm512_add_ps(x, bf16x16_load(delta + i)));
            _mm256_storeu_si256((__m256i *)(res + i), sum);
            x = bf16x16_to_f32(sum);
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(x, x));
    }
    float lanes[LANES];
    _mm512_storeu_ps(lanes, acc);
    for (; i < hidden; i++) {
        if (delta)
            res[i] = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(delta[i]));
        const float x = bf16_to_f32(res[i]);
        lanes[0] += x * x;
    }
    float ss = 0.f;
    for (int l = 0; l < LANES; l++)
        ss += lanes[l];
    const float inv_s = 1.f / sqrtf(ss / (float)hidden + eps);
    const __m512 inv = _mm512_set1_ps(inv_s);
    int64_t j = 0;
    for (; j + LANES <= hidden; j += LANES)
        bf16x16_store(out + j, _mm512_mul_ps(bf16x16_load(w + j), bf16x16_round(_mm512_mul_ps(bf16x16_load(res + j), inv))));
    for (; j < hidden; j++)
        out[j] = f32_to_bf16(bf16_to_f32(w[j]) * round_dt(bf16_to_f32(res[j]) * inv_s, 1));
}
#endif

/* residual += delta (rounded; skipped when delta is NULL), then
 * out = weight * dt(residual * rsqrt(mean(residual^2) + eps)): HF's LlamaRMSNorm after the residual add. */
int pd_add_rms_norm(void *out, void *residual, const void *delta, const void *weight, int64_t rows,
                    int64_t hidden, float eps, int dt, int nthreads) {
    const int par = rows * hidden >= PAR_MIN_ELEMS;
    ROWS_FOR(rows) {
#ifdef PD_BF16X16
        if (dt)
            add_rms_norm_row_bf16x16((uint16_t *)out + r * hidden, (uint16_t *)residual + r * hidden,
                                     delta ? (const uint16_t *)delta + r * hidden : NULL, weight, hidden, eps);
#else
        if (dt)
            add_rms_norm_row(out, residual, delta, weight, r * hidden, hidden, eps, 1);
#endif
        else
            add_rms_norm_row(out, residual, delta, weight, r * hidden, hidden, eps, 0);
    }
    return 0;
}

/* out[r, h, :] = x[r, h, :] * cos[r] + swap_halves(x[r, h, :]) * sin[r], each product and the sum
 * rounded to dt (the sign of rotate_half is folded into sin's first half by the caller's table).
 * x rows are x_stride elements apart (a slice of the fused qkv output); out is dense. */
INLINE void rope_row(void *out, const void *x, int64_t xb, int64_t ob, const void *cos, const void *sin,
                     int64_t tb, int heads, int head_dim, const int dt) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        const int64_t xh = xb + (int64_t)h * head_dim, oh = ob + (int64_t)h * head_dim;
        for (int k = 0; k < 2; k++) { /* first half: partner i + half; second: i - half */
            const int lo = k * half, shift = k ? -half : half;
            for (int i = lo; i < lo + half; i++) {
                const float a = round_dt(LD(x, dt, xh + i) * LD(cos, dt, tb + i), dt);
                const float b = round_dt(LD(x, dt, xh + i + shift) * LD(sin, dt, tb + i), dt);
                st(out, dt, oh + i, a + b);
            }
        }
    }
}

#ifdef PD_BF16X16
/* rope_row for bf16 when a half head is whole vectors: the same three roundings per element. */
static void rope_row_bf16x16(uint16_t *out, const uint16_t *x, const uint16_t *cos, const uint16_t *sin, int heads,
                             int head_dim) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        const uint16_t *xh = x + (int64_t)h * head_dim;
        uint16_t *oh = out + (int64_t)h * head_dim;
        for (int i = 0; i < head_dim; i += LANES) {
            const int partner = i < half ? i + half : i - half;
            const __m512 a = bf16x16_round(_mm512_mul_ps(bf16x16_load(xh + i), bf16x16_load(cos + i)));
            const __m512 b = bf16x16_round(_mm512_mul_ps(bf16x16_load(xh + partner), bf16x16_load(sin + i)));
            bf16x16_store(oh + i, _mm512_add_ps(a, b));
        }
    }
}
#endif

int pd_rope(void *out, const void *x, int64_t x_stride, const void *cos, const void *sin, int64_t rows,
            int heads, int head_dim, int dt, int nthreads) {
    const int64_t cols = (int64_t)heads * head_dim;
    const int par = rows * cols >= PAR_MIN_ELEMS;
#ifdef PD_BF16X16
    const int vec = (head_dim / 2) % LANES == 0;
#endif
    ROWS_FOR(rows) {
#ifdef PD_BF16X16
        if (dt && vec)
            rope_row_bf16x16((uint16_t *)out + r * cols, (const uint16_t *)x + r * x_stride,
                             (const uint16_t *)cos + r * head_dim, (const uint16_t *)sin + r * head_dim, heads,
                             head_dim);
        else
#endif
        if (dt)
            rope_row(out, x, r * x_stride, r * cols, cos, sin, r * head_dim, heads, head_dim, 1);
        else
            rope_row(out, x, r * x_stride, r * cols, cos, sin, r * head_dim, heads, head_dim, 0);
    }
    return 0;
}

/* g / (1 + exp(-g)); below -88 exp(-g) is inf in fp32 and torch's quotient is -0. */
static inline float silu(float g) { return g < -88.f ? 0.f * g : g / (1.f + pd_expf(-g)); }

/* out[r] = dt(silu(gate[r])) * up[r], gate and up the two halves of a fused gate_up row
 * (silu(g) = g / (1 + exp(-g)) in fp32, as torch computes it, rounded before the product). */
INLINE void silu_mul_row(void *out, const void *gate_up, int64_t gb, int64_t ob, int64_t inter, const int dt) {
    for (int64_t i = 0; i < inter; i++)
        st(out, dt, ob + i, round_dt(silu(LD(gate_up, dt, gb + i)), dt) * LD(gate_up, dt, gb + inter + i));
}

#ifdef PD_BF16X16
/* silu_mul_row for bf16: exp16 is pd_expf's scheme lane for lane (vec_exp.h), the division and both
 * roundings as above; below -88 the quotient is -0 (0 * g) as in silu(). */
static void silu_mul_row_bf16x16(uint16_t *out, const uint16_t *gate, const uint16_t *up, int64_t inter) {
    int64_t i = 0;
    for (; i + LANES <= inter; i += LANES) {
        const __m512 g = bf16x16_load(gate + i);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        s = _mm512_mask_mul_ps(s, _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.f), _CMP_LT_OQ), _mm512_setzero_ps(), g);
        bf16x16_store(out + i, _mm512_mul_ps(bf16x16_round(s), bf16x16_load(up + i)));
    }
    for (; i < inter; i++)
        out[i] = f32_to_bf16(round_dt(silu(bf16_to_f32(gate[i])), 1) * bf16_to_f32(up[i]));
}
#endif

int pd_silu_mul(void *out, const void *gate_up, int64_t rows, int64_t inter, int dt, int nthreads) {
    const int par = rows * inter >= PAR_MIN_ELEMS;
    ROWS_FOR(rows) {
#ifdef PD_BF16X16
        if (dt)
            silu_mul_row_bf16x16((uint16_t *)out + r * inter, (const uint16_t *)gate_up + r * 2 * inter,
                                 (const uint16_t *)gate_up + r * 2 * inter + inter, inter);
#else
        if (dt)
            silu_mul_row(out, gate_up, r * 2 * inter, r * inter, inter, 1);
#endif
        else
            silu_mul_row(out, gate_up, r * 2 * inter, r * inter, inter, 0);
    }
    return 0;
}
