/* The vector mapping: the one header of the generic layer that tests the instruction set (every other
 * ISA branch lives in kernels/x86/ or kernels/arm/; tests/kernels/test_layout.py checks). 8-lane fp32
 * vectors: one __m256 on AVX2+FMA, two float32x4_t on aarch64 NEON; kernels/cpu_v8.h's kernels are
 * written once over them. LMI_V8 is 1 where they exist (0 elsewhere: nothing else defined).
 *
 * Every operation rounds as the scalar IEEE one would (v8f_fma: one rounding, x86 vfmadd and
 * Arm fmla alike), so a kernel written on these gives the same bits on either, and the same
 * bits as an AVX-512 kernel doing the same operations in the same order per element.
 *
 *   v8f_zero() v8f_set1(x) v8f_load(p) v8f_store(p, v)     p: 8 floats, any alignment
 *   v8f_load_n(p, n) v8f_store_n(p, v, n)                  the first n (0..8) lanes; the rest 0 / untouched
 *   v8f_add(a, b) v8f_mul(a, b) v8f_fma(a, b, c) = a * b + c (fused)
 *   v8f_f16(p) v8f_i8(p) v8f_u8(p)  8 fp16 / int8 / uint8 values at p widened to fp32 (exact)
 *   v8f_codes(b, shift, pl, planes) 8 codes of 4 + planes bits (grouped weights, kernels/cpu_gemm_q4.c):
 *                                  the nibbles of bytes b[0..7] (shift 0: low, 4: high), bit 4 + i
 *                                  of lane j from bit j of byte pl[4 i], as fp32 (exact)
 *   v8f_bf16_lo(p) v8f_bf16_hi(p)  p: 8 32-bit words of two bf16 each: the low (high) halves widened (exact)
 *   v8f_store_bf16_n(p, v, n)      the first n lanes rounded to bf16 (nearest even; NaN stays NaN,
 *                                  quieted: cpu_bf16.h's f32_to_bf16)
 *   LMI_PREFETCH_L1(p) LMI_PREFETCH_L2(p)
 *   LMI_V8_SEQ()   between the loads of a register block's column groups: no load moves across
 *                  it (aarch64; nothing on x86). Left free, gcc hoists all of a panel row's loads
 *                  ahead of the FMAs and spills accumulators every k (3 rows x 32 columns: 24 of
 *                  the 32 q registers hold accumulators).
 */
#ifndef LMI_CPU_SIMD_H
#define LMI_CPU_SIMD_H
#include <stdint.h>
#include <string.h>

#define LMI_PREFETCH_L1(p) __builtin_prefetch((const void *)(p), 0, 3)
#define LMI_PREFETCH_L2(p) __builtin_prefetch((const void *)(p), 0, 2)

#if defined(__AVX2__) && defined(__FMA__)
#define LMI_V8 1
#include <immintrin.h>

#define LMI_V8_SEQ() ((void)0)

typedef __m256 v8f;

static inline v8f v8f_zero(void) { return _mm256_setzero_ps(); }
static inline v8f v8f_set1(float x) { return _mm256_set1_ps(x); }
static inline v8f v8f_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v8f_store(float *p, v8f v) { _mm256_storeu_ps(p, v); }
static inline v8f v8f_add(v8f a, v8f b) { return _mm256_add_ps(a, b); }
static inline v8f v8f_mul(v8f a, v8f b) { return _mm256_mul_ps(a, b); }
static inline v8f v8f_fma(v8f a, v8f b, v8f c) { return _mm256_fmadd_ps(a, b, c); }
static inline v8f v8f_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline v8f v8f_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline v8f v8f_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline v8f v8f_codes(const uint8_t *b, int shift, const uint8_t *pl, int planes) {
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    x = shift ? _mm256_srli_epi32(x, 4) : _mm256_and_si256(x, _mm256_set1_epi32(0xF));
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int i = 0; i < planes; ++i) {
        const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(pl[4 * i]), sel), sel);
        x = _mm256_or_si256(x, _mm256_and_si256(on, _mm256_set1_epi32(16 << i)));
    }
    return _mm256_cvtepi32_ps(x);
}

static inline __m256i v8_mask_(int n) {   /* lanes < n all ones */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline v8f v8f_load_n(const float *p, int n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, v8_mask_(n));
}
static inline void v8f_store_n(float *p, v8f v, int n) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else if (n > 0) _mm256_maskstore_ps(p, v8_mask_(n), v);
}
static inline v8f v8f_bf16_lo(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16));
}
static inline v8f v8f_bf16_hi(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p),
                                                _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void v8f_store_bf16_n(uint16_t *p, v8f v, int n) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    if (n >= 8) {
        _mm_storeu_si128((__m128i *)p, h);
    } else if (n > 0) {
        uint16_t t[8];
        _mm_storeu_si128((__m128i *)t, h);
        memcpy(p, t, (size_t)n * 2);
    }
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
#define LMI_V8 1
#include <arm_neon.h>

#define LMI_V8_SEQ() __asm__ volatile("" ::: "memory")

typedef struct { float32x4_t lo, hi; } v8f;

static inline v8f v8f_zero(void) { v8f r = {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; return r; }
static inline v8f v8f_set1(float x) { v8f r = {vdupq_n_f32(x), vdupq_n_f32(x)}; return r; }
static inline v8f v8f_load(const float *p) { v8f r = {vld1q_f32(p), vld1q_f32(p + 4)}; return r; }
static inline void v8f_store(float *p, v8f v) { vst1q_f32(p, v.lo); vst1q_f32(p + 4, v.hi); }
static inline v8f v8f_add(v8f a, v8f b) { v8f r = {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; return r; }
static inline v8f v8f_mul(v8f a, v8f b) { v8f r = {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; return r; }
static inline v8f v8f_fma(v8f a, v8f b, v8f c) {
    v8f r = {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)};
    return r;
}
static inline v8f v8f_f16(const uint16_t *p) {
    v8f r = {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))), vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4)))};
    return r;
}
static inline v8f v8f_i8(const int8_t *p) {
    const int16x8_t w = vmovl_s8(vld1_s8(p));
    v8f r = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_high_s16(w))};
    return r;
}
static inline v8f v8_u8x8_f32_(uint8x8_t x) {
    const uint16x8_t w = vmovl_u8(x);
    v8f r = {vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), vcvtq_f32_u32(vmovl_high_u16(w))};
    return r;
}
static inline v8f v8f_u8(const uint8_t *p) { return v8_u8x8_f32_(vld1_u8(p)); }
static inline v8f v8f_codes(const uint8_t *b, int shift, const uint8_t *pl, int planes) {
    uint8x8_t x = vld1_u8(b);
    x = shift ? vshr_n_u8(x, 4) : vand_u8(x, vdup_n_u8(0xF));
    static const uint8_t SEL[8] = {1, 2, 4, 8, 16, 32, 64, 128};
    for (int i = 0; i < planes; ++i)
        x = vorr_u8(x, vand_u8(vtst_u8(vdup_n_u8(pl[4 * i]), vld1_u8(SEL)), vdup_n_u8((uint8_t)(16 << i))));
    return v8_u8x8_f32_(x);
}
static inline v8f v8f_load_n(const float *p, int n) {
    if (n >= 8) return v8f_load(p);
    float t[8] = {0};
    if (n > 0) memcpy(t, p, (size_t)n * 4);
    return v8f_load(t);
}
static inline void v8f_store_n(float *p, v8f v, int n) {
    if (n >= 8) {
        v8f_store(p, v);
    } else if (n > 0) {
        float t[8];
        v8f_store(t, v);
        memcpy(p, t, (size_t)n * 4);
    }
}
static inline v8f v8f_bf16_lo(const uint16_t *p) {
    const uint32_t *q = (const uint32_t *)p;
    v8f r = {vreinterpretq_f32_u32(vshlq_n_u32(vld1q_u32(q), 16)),
             vreinterpretq_f32_u32(vshlq_n_u32(vld1q_u32(q + 4), 16))};
    return r;
}
static inline v8f v8f_bf16_hi(const uint16_t *p) {
    const uint32_t *q = (const uint32_t *)p;
    const uint32x4_t m = vdupq_n_u32(0xFFFF0000u);
    v8f r = {vreinterpretq_f32_u32(vandq_u32(vld1q_u32(q), m)), vreinterpretq_f32_u32(vandq_u32(vld1q_u32(q + 4), m))};
    return r;
}
static inline uint16x4_t v8_round_bf16_(float32x4_t v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
    const uint32x4_t nan = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
    return vmovn_u32(vbslq_u32(vceqq_f32(v, v), r, nan));     /* v == v: not NaN */
}
static inline void v8f_store_bf16_n(uint16_t *p, v8f v, int n) {
    const uint16x8_t h = vcombine_u16(v8_round_bf16_(v.lo), v8_round_bf16_(v.hi));
    if (n >= 8) {
        vst1q_u16(p, h);
    } else if (n > 0) {
        uint16_t t[8];
        vst1q_u16(t, h);
        memcpy(p, t, (size_t)n * 2);
    }
}

#else
#define LMI_V8 0
#endif
#endif
