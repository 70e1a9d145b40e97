/* CPU element-wise kernels that must round exactly as transformers' torch ops do (built
 * without -ffast-math and without FMA contraction: kernels/cpu_ext.py). */
#include <stdint.h>

#include "cpu_bf16.h"

/* Rotary embedding in place, Llama's form: x*cos + rotate_half(x)*sin with
 * rotate_half(x) = cat(-x[D/2:], x[:D/2]); each product and the sum rounded as torch rounds
 * them (fp32, or bf16 after each op). q [T, H, D] / k [T, Hkv, D] rows at element strides
 * qs/ks per token (heads contiguous within a token), cos/sin [T, D] at stride cs. */
static void rope_rows(void *x, int64_t xs, int64_t nh, const void *cos, const void *sin, int64_t cs,
                      int64_t t, int64_t D, int bf16) {
    const int64_t half = D / 2;
    if (bf16) {
        const uint16_t *c = (const uint16_t *)cos + t * cs, *s = (const uint16_t *)sin + t * cs;
        for (int64_t h = 0; h < nh; ++h) {
            uint16_t *r = (uint16_t *)x + t * xs + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = bf16_to_f32(r[i]), b = bf16_to_f32(r[i + half]);
                const float lo = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[i])))
                               + bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(s[i])));
                const float hi = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[i + half])))
                               + bf16_to_f32(f32_to_bf16(a * bf16_to_f32(s[i + half])));
                r[i] = f32_to_bf16(lo);
                r[i + half] = f32_to_bf16(hi);
            }
        }
    } else {
        const float *c = (const float *)cos + t * cs, *s = (const float *)sin + t * cs;
        for (int64_t h = 0; h < nh; ++h) {
            float *r = (float *)x + t * xs + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = r[i], b = r[i + half];
                r[i] = a * c[i] + (-b) * s[i];
                r[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

void lmi_rotary(void *q, void *k, const void *cos, const void *sin, int64_t T, int64_t H, int64_t Hkv,
                int64_t D, int64_t qs, int64_t ks, int64_t cs, int bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T * (H + Hkv) * D >= 65536) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        rope_rows(q, qs, H, cos, sin, cs, t, D, bf16);
        rope_rows(k, ks, Hkv, cos, sin, cs, t, D, bf16);
    }
}
