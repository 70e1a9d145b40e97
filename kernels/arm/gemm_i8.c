/* The int8 GEMM's aarch64 NEON kernels (kernels/cpu_arch.h's lmi_arch_i8_*; kernels/cpu_gemm_i8.c
 * quantizes the rows, packs and drives): sdot (armv8.2-a dotprod) over kernels/cpu_v8.h's 8-column
 * blocks of up to 3 rows, signed q = Aq - 128 (Aq ^ 0x80) x signed bytes summed 4 at a time into
 * int32 lanes (no wsum correction); the x86 builds' int32 sums and fp32 epilogue, so their values bit
 * for bit (and lmi_arch_i8_absmax / _quant their bytes). */
#include <stdint.h>
#include <string.h>

#include <arm_neon.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32

/* x86's maxps(a, b): a > b ? a : b (the second operand when either is NaN), so the NaN cases pick
 * what the x86 builds pick too. */
static inline float32x4_t i8_maxps(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float i8_reduce_max16(float32x4_t l0, float32x4_t l1, float32x4_t h0, float32x4_t h1) {
    const float32x4_t t3a = i8_maxps(h0, l0), t3b = i8_maxps(h1, l1);   /* lanes 0-3, 4-7 of the 256-bit max */
    const float32x4_t t6 = i8_maxps(t3b, t3a);
    const float32x4_t t8 = i8_maxps(t6, vextq_f32(t6, t6, 2));               /* shuffle {2, 3, 0, 1} */
    const float32x4_t t10 = i8_maxps(t8, vrev64q_f32(t8));                    /* lane 0 against lane 1 */
    return vgetq_lane_f32(t10, 0);
}
/* 4 lanes of a * inv rounded to nearest even, as x86's vcvtps2dq (NaN and |x| >= 2^31 give
 * INT_MIN there, saturation here: made INT_MIN too), clamped to [-127, 127], + 128. */
static inline int32x4_t i8_quant4(const float *a, float32x4_t vinv) {
    const float32x4_t x = vmulq_f32(vld1q_f32(a), vinv);
    int32x4_t q = vcvtnq_s32_f32(x);
    q = vbslq_s32(vcaltq_f32(x, vdupq_n_f32(2147483648.f)), q, vdupq_n_s32(INT32_MIN));
    return vaddq_s32(vminq_s32(vmaxq_s32(q, vdupq_n_s32(-127)), vdupq_n_s32(127)), vdupq_n_s32(128));
}

/* The max of |a[k]|, k < n (a multiple of 16), 16 lanes at a time, reduced in the order of gcc's
 * _mm512_reduce_max_ps (every build: the same value, even for a NaN); 0 for n = 0. */
float lmi_arch_i8_absmax(const float *a, int64_t n) {
    float amax = 0.f;
    int64_t k = 0;
    float32x4_t v0 = vdupq_n_f32(0.f), v1 = v0, v2 = v0, v3 = v0;
    for (; k + 16 <= n; k += 16) {
        v0 = i8_maxps(v0, vabsq_f32(vld1q_f32(a + k)));
        v1 = i8_maxps(v1, vabsq_f32(vld1q_f32(a + k + 4)));
        v2 = i8_maxps(v2, vabsq_f32(vld1q_f32(a + k + 8)));
        v3 = i8_maxps(v3, vabsq_f32(vld1q_f32(a + k + 12)));
    }
    amax = i8_reduce_max16(v0, v1, v2, v3);
    return amax;
}

/* o[k] = clamp(round_even(a[k] * inv), -127, 127) + 128 for k < n (a multiple of 16). */
void lmi_arch_i8_quant(const float *a, int64_t n, float inv, uint8_t *o) {
    int64_t k = 0;
    const float32x4_t vinv = vdupq_n_f32(inv);
    for (; k + 16 <= n; k += 16) {
        const uint16x8_t w0 = vreinterpretq_u16_s16(vcombine_s16(vmovn_s32(i8_quant4(a + k, vinv)),
                                                                 vmovn_s32(i8_quant4(a + k + 4, vinv))));
        const uint16x8_t w1 = vreinterpretq_u16_s16(vcombine_s16(vmovn_s32(i8_quant4(a + k + 8, vinv)),
                                                                 vmovn_s32(i8_quant4(a + k + 12, vinv))));
        vst1q_u8(o + k, vcombine_u8(vmovn_u16(w0), vmovn_u16(w1)));
    }
}

typedef struct { int32x4_t lo, hi; } i8acc;
typedef int8x16_t i8row;
typedef struct { int8x16_t lo, hi; } i8w;
typedef struct { float32x4_t lo, hi; } i8f;
static inline i8acc i8acc_zero(void) { i8acc r = {vdupq_n_s32(0), vdupq_n_s32(0)}; return r; }
static inline i8row i8row_load(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return vreinterpretq_s8_u8(veorq_u8(vreinterpretq_u8_u32(vdupq_n_u32(v)), vdupq_n_u8(0x80)));
}
static inline i8w i8w_load(const int8_t *p) { i8w r = {vld1q_s8(p), vld1q_s8(p + 16)}; return r; }
static inline i8acc i8_dot(i8acc acc, i8row a, i8w w) {
    i8acc r = {vdotq_s32(acc.lo, w.lo, a), vdotq_s32(acc.hi, w.hi, a)};
    return r;
}
static inline i8f i8f_load_n(const float *p, int n) {
    float t[8] = {0};
    if (n > 0) memcpy(t, p, (size_t)(n < 8 ? n : 8) * 4);
    i8f r = {vld1q_f32(t), vld1q_f32(t + 4)};
    return r;
}
static inline void i8f_store_n(float *p, i8f v, int n) {
    if (n >= 8) {
        vst1q_f32(p, v.lo);
        vst1q_f32(p + 4, v.hi);
    } else if (n > 0) {
        float t[8];
        vst1q_f32(t, v.lo);
        vst1q_f32(t + 4, v.hi);
        memcpy(p, t, (size_t)n * 4);
    }
}
static inline i8acc i8_unoffset(i8acc acc, const int32_t *wsum, int n) {
    (void)wsum, (void)n;
    return acc;
}
static inline i8f i8_epilogue(i8acc acc, i8f s, float a, i8f b) {
    const float32x4_t va = vdupq_n_f32(a);
    i8f r = {vfmaq_f32(b.lo, vmulq_f32(vcvtq_f32_s32(acc.lo), s.lo), va),
             vfmaq_f32(b.hi, vmulq_f32(vcvtq_f32_s32(acc.hi), s.hi), va)};
    return r;
}

#define LMI_V8_I8
#include "../cpu_v8.h"

int lmi_arch_i8_rows(void) { return V8_I8_ROWS; }

void lmi_arch_i8_block(const lmi_i8_args *c, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const int8_t *B = c->Bp + p * c->kq * NR * 4;
    V8_I8[rows](lmi_i8_row(c, row), c->A.ldp_bytes, B, c->kq, c->C + row * c->ldc + p * NR, c->ldc, c->sa + row,
                c->sw + p * NR, c->wsum + p * NR, c->bias ? c->bias + p * NR : 0,
                c->N - p * NR < NR ? c->N - p * NR : NR, next ? B + c->kq * NR * 4 : 0, i, nb);
}

int lmi_arch_i8_widened(void) { return 0; }

void lmi_arch_i8_widen(const uint8_t *Aq, int64_t rows, int64_t Kp, int16_t *out, int64_t ldo) {
    (void)Aq; (void)rows; (void)Kp; (void)out; (void)ldo;
}
