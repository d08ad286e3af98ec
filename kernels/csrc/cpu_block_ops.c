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
 * Built with -ffp-contract=off -fno-associative-math -fsigned-zeros (kernels/cpu_block_ops.py): no
 * a*b+c may become one fused multiply-add with a single rounding where torch rounds twice, no product
 * of three may be regrouped, and -0 stays -0.
 *
 * dt: 0 float32, 1 bfloat16 (kernels/cpu_block_ops.py checks dtypes, shapes and strides).
 * Rows run in parallel (OpenMP, torch's team) only when there are enough elements to pay for it.
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

/* residual += delta (rounded; skipped when delta is NULL), then
 * out = weight * dt(residual * rsqrt(mean(residual^2) + eps)): HF's LlamaRMSNorm after the residual add. */
int pd_add_rms_norm(void *out, void *residual, const void *delta, const void *weight, int64_t rows,
                    int64_t hidden, float eps, int dt, int nthreads) {
    const int par = rows * hidden >= PAR_MIN_ELEMS;
    ROWS_FOR(rows) {
        if (dt)
            add_rms_norm_row(out, residual, delta, weight, r * hidden, hidden, eps, 1);
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

int pd_rope(void *out, const void *x, int64_t x_stride, const void *cos, const void *sin, int64_t rows,
            int heads, int head_dim, int dt, int nthreads) {
    const int64_t cols = (int64_t)heads * head_dim;
    const int par = rows * cols >= PAR_MIN_ELEMS;
    ROWS_FOR(rows) {
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

int pd_silu_mul(void *out, const void *gate_up, int64_t rows, int64_t inter, int dt, int nthreads) {
    const int par = rows * inter >= PAR_MIN_ELEMS;
    ROWS_FOR(rows) {
        if (dt)
            silu_mul_row(out, gate_up, r * 2 * inter, r * inter, inter, 1);
        else
            silu_mul_row(out, gate_up, r * 2 * inter, r * inter, inter, 0);
    }
    return 0;
}
