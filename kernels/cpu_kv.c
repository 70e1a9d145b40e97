/* The int8 KV pool's rows (kernels/cpu_kv.h): quantizing rows into the pool, and the round trip a
 * prompt's own attention reads. Compiled without -ffast-math and without FMA contraction
 * (kernels/cpu/build.py EXACT_FLAGS): the bytes are kernels/pool.py's, bit for bit. */
#include <math.h>
#include <stdint.h>

#include "cpu_api.h"
#include "cpu_bf16.h"
#include "cpu_kv.h"

/* One row x[0:D] (fp32, or bf16 widened) as int8 q[0:D] and its scale: symmetric, per row,
 * scale = max|x| / 127, q = round_half_even(x * (127 / max|x|)) (all zeros for a zero row), in
 * torch's fp32 operations and rounding (this file has no fast-math): kernels/reference.py
 * quantize_rows gives the same bytes. */
static void quant_row(const void *x, int bf16, int64_t D, int8_t *q, float *sc) {
    float m = 0.f;
    for (int64_t d = 0; d < D; ++d) {
        const float a = fabsf(bf16 ? bf16_to_f32(((const uint16_t *)x)[d]) : ((const float *)x)[d]);
        m = a > m ? a : m;
    }
    const float inv = m > 0.f ? 127.f / m : 0.f;
    *sc = m / 127.f;
    for (int64_t d = 0; d < D; ++d) {
        const float y = nearbyintf((bf16 ? bf16_to_f32(((const uint16_t *)x)[d]) : ((const float *)x)[d]) * inv);
        q[d] = (int8_t)(y > 127.f ? 127.f : y < -127.f ? -127.f : y);
    }
}

/* Rows x [T, Hkv, D] (row t's head h at x + t * tok + h * D elements, fp32 or bf16) replaced in
 * place by what an int8 pool stores of them, dequantized (q * scale, rounded to bf16 for bf16):
 * a prompt's attention reads the values its decode steps will read back. */
void lmi_kv_i8_roundtrip(void *x, int bf16, int64_t T, int64_t Hkv, int64_t D, int64_t tok, int8_t *q) {
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t at = t * tok + h * D;
            float sc;
            if (bf16) {
                uint16_t *r = (uint16_t *)x + at;
                quant_row(r, 1, D, q, &sc);
                for (int64_t d = 0; d < D; ++d) r[d] = f32_to_bf16((float)q[d] * sc);
            } else {
                float *r = (float *)x + at;
                quant_row(r, 0, D, q, &sc);
                for (int64_t d = 0; d < D; ++d) r[d] = (float)q[d] * sc;
            }
        }
}

/* lmi_write_kv into int8 pools: key/value rows [T, Hkv, D] (fp32, or bf16 when bf16; element
 * strides token / head, D contiguous) quantized per (token, head) row into kc / vc at slots[T]
 * (negative: skipped), each row's scale into ksc / vsc at its element offset / D. -1 (nothing
 * written) when a slot is >= nslots. */
int lmi_write_kv_i8(int8_t *kc, int8_t *vc, float *ksc, float *vsc, const void *key, const void *value, int bf16,
                    int64_t s_blk, int64_t s_tok, int64_t s_head, int64_t k_tok, int64_t k_head, int64_t v_tok,
                    int64_t v_head, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t bs,
                    int64_t nslots) {
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= nslots) return -1;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t base = (slot / bs) * s_blk + (slot % bs) * s_tok;
        for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t at = base + h * s_head;
            quant_row((const char *)key + (t * k_tok + h * k_head) * es, bf16, D, kc + at, ksc + at / D);
            quant_row((const char *)value + (t * v_tok + h * v_head) * es, bf16, D, vc + at, vsc + at / D);
        }
    }
    return 0;
}
