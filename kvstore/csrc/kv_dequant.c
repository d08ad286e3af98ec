/* The 8-bit stored KV codecs' decode (kvstore/payload_codecs.py): every code times its group's scale, written
 * in the KV's dtype, in one pass.
 *
 * Called through ctypes (the GIL is released) by payload_codecs.decode on a store's I/O threads, so it is plain
 * single-threaded C (no OpenMP region: an I/O thread must not start a team of its own). Group g holds
 * codes[g * dim .. (g + 1) * dim) and scales[g]; a code is an int8 value, or with `table` (256 floats) the
 * index of its value (e4m3). out_code is kvstore/object_format.py's dtype code of `out`: 1 float32, 2 float16,
 * 3 bfloat16 (both rounded to nearest even, as torch converts). Returns 0, or -1 for another out_code.
 *
 * pd_decode_spans decodes a whole layer's objects in one call (the batched coded load,
 * kvstore/coded_reads.py): each object's decoded bytes fill its pieces of a span table (kvstore/spans.py:
 * paged KV blocks, scratch, a staging buffer) in order, as a raw object's payload would.
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

/* One piece of an object: elements [e, e + m) of its decoded stream into dst. A piece made of whole
 * groups (every piece of a load into blocks or staging: rows of H * dim values) runs the per-group loop
 * the compiler vectorizes; any other cut, element by element. */
#define PIECE_8BIT(T, CONVERT)                                                                       \
    do {                                                                                             \
        T *o = (T *)dst;                                                                             \
        if (e % dim == 0 && m % dim == 0) {                                                          \
            for (int64_t g = e / dim; g < (e + m) / dim; g++, o += dim) {                            \
                float scale;                                                                         \
                memcpy(&scale, scales + 4 * g, sizeof scale);                                        \
                const uint8_t *c = codes + g * dim;                                                  \
                if (table) {                                                                         \
                    for (int64_t d = 0; d < dim; d++) o[d] = CONVERT(e4m3(c[d]) * scale);            \
                } else {                                                                             \
                    for (int64_t d = 0; d < dim; d++) o[d] = CONVERT((float)(int8_t)c[d] * scale);   \
                }                                                                                    \
            }                                                                                        \
        } else {                                                                                     \
            for (int64_t k = 0; k < m; k++) {                                                        \
                float scale;                                                                         \
                memcpy(&scale, scales + 4 * ((e + k) / dim), sizeof scale);                          \
                uint8_t c = codes[e + k];                                                            \
                o[k] = CONVERT((table ? table[c] : (float)(int8_t)c) * scale);                       \
            }                                                                                        \
        }                                                                                            \
    } while (0)

/* An e4m3 code's value in arithmetic the compiler vectorizes (a table lookup is a gather, ~3x slower here):
 * the same values as the table of payload_codecs.py, NaN codes (never written by the encoder) 0 as there. */
static inline float e4m3(uint8_t code) {
    const uint32_t em = code & 0x7Fu;
    const float sub = (float)(em & 7u) * (1.0f / 512.0f);  /* subnormal: m * 2^-9 */
    uint32_t sub_bits, bits;
    memcpy(&sub_bits, &sub, sizeof sub_bits);
    bits = em >> 3 ? (em << 20) + (120u << 23) : sub_bits;  /* normal: exponent bias 7 -> 127 */
    bits = em == 0x7Fu ? 0u : bits | (uint32_t)(code & 0x80u) << 24;  /* selects on integers: vectorized */
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#define AS_F32(v) (v)
#define AS_F16(v) ((_Float16)(v))

/* Object i of codec[i] (0 raw bytes, 1 byte planes: itemsize planes of count[i] bytes each, already
 * decompressed; 2 int8, 3 e4m3 through `table`: float32 scales [count[i] / dim] then count[i] codes) at
 * src[i] fills pieces desc[first[i] .. first[i + 1]) (region, byte offset, nbytes; region addresses in
 * bases) with its count[i] values of out_code's dtype (kv_dequant's codes; itemsize bytes each), in order.
 * Checked before anything is written: every piece a whole number of values, each object's pieces exactly
 * its values. Returns 0, -1 for an unknown out_code or codec, -2 for pieces that do not fit. */
int pd_decode_spans(int64_t n, const int64_t *codec, const uint64_t *src, const int64_t *count, int64_t dim,
                    const int64_t *desc, const int64_t *first, const uint64_t *bases, const float *table,
                    int out_code) {
    const int64_t itemsize = out_code == 1 ? 4 : out_code == 2 || out_code == 3 ? 2 : 0;
    if (!itemsize || dim <= 0) return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t total = 0;
        if (codec[i] < 0 || codec[i] > 3) return -1;
        if (codec[i] >= 2 && count[i] % dim) return -2;
        for (int64_t k = first[i]; k < first[i + 1]; k++) {
            if (desc[3 * k + 2] % itemsize) return -2;
            total += desc[3 * k + 2];
        }
        if (total != count[i] * itemsize) return -2;
    }
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *payload = (const uint8_t *)(uintptr_t)src[i];
        const uint8_t *scales = payload;
        const uint8_t *codes = payload + 4 * (count[i] / dim);
        const float *lut = codec[i] == 3 ? table : NULL;
        int64_t e = 0;
        for (int64_t k = first[i]; k < first[i + 1]; k++) {
            uint8_t *dst = (uint8_t *)(uintptr_t)bases[desc[3 * k]] + desc[3 * k + 1];
            const int64_t m = desc[3 * k + 2] / itemsize;
            if (codec[i] == 0) {
                memcpy(dst, payload + e * itemsize, (size_t)(m * itemsize));
            } else if (codec[i] == 1 && itemsize == 2) {  /* the common case, in a loop the compiler vectorizes */
                const uint8_t *low = payload + e, *high = payload + count[i] + e;
                uint16_t *o = (uint16_t *)dst;
                for (int64_t v = 0; v < m; v++) o[v] = (uint16_t)(low[v] | high[v] << 8);
            } else if (codec[i] == 1) {
                for (int64_t b = 0; b < itemsize; b++) {
                    const uint8_t *plane = payload + b * count[i] + e;
                    for (int64_t v = 0; v < m; v++) dst[v * itemsize + b] = plane[v];
                }
            } else {
                const float *table = lut;
                if (out_code == 1) {
                    PIECE_8BIT(float, AS_F32);
                } else if (out_code == 2) {
                    PIECE_8BIT(_Float16, AS_F16);
                } else {
                    PIECE_8BIT(uint16_t, to_bf16);
                }
            }
            e += m;
        }
    }
    return 0;
}
