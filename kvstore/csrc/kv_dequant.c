/* The 8-bit stored KV codecs' decode (kvstore/kv_codecs.py): every code times its group's scale, written
 * in the KV's dtype, in one pass.
 *
 * Called through ctypes (the GIL is released) by kv_codecs.decode on a store's I/O threads, so it is plain
 * single-threaded C (no OpenMP region: an I/O thread must not start a team of its own). Group g holds
 * codes[g * dim .. (g + 1) * dim) and scales[g]; a code is an int8 value, or with `table` (256 floats) the
 * index of its value (e4m3). out_code is kvstore/codec.py's dtype code of `out`: 1 float32, 2 float16,
 * 3 bfloat16 (both rounded to nearest even, as torch converts). Returns 0, or -1 for another out_code.
 */
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#define DEQUANT_LOOP(STORE)                                                                  \
    for (int64_t g = 0; g < groups; g++) {                                                   \
        const float scale = scales[g];                                                       \
        const uint8_t *c = codes + g * dim;                                                  \
        if (table) {                                                                         \
            for (int64_t d = 0; d < dim; d++) STORE(g * dim + d, table[c[d]] * scale);       \
        } else {                                                                             \
            for (int64_t d = 0; d < dim; d++) STORE(g * dim + d, (float)(int8_t)c[d] * scale); \
        }                                                                                    \
    }

int pd_dequant(int64_t groups, int64_t dim, const uint8_t *codes, const float *scales, const float *table, void *out,
               int out_code) {
    if (out_code == 1) {
        float *o = (float *)out;
#define STORE_F32(i, v) (o[i] = (v))
        DEQUANT_LOOP(STORE_F32)
    } else if (out_code == 2) {
        _Float16 *o = (_Float16 *)out;
#define STORE_F16(i, v) (o[i] = (_Float16)(v))
        DEQUANT_LOOP(STORE_F16)
    } else if (out_code == 3) {
        uint16_t *o = (uint16_t *)out;
#define STORE_BF16(i, v) (o[i] = to_bf16(v))
        DEQUANT_LOOP(STORE_BF16)
    } else {
        return -1;
    }
    return 0;
}
