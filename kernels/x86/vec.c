/* torch's Vectorized<float> on x86 for kernels/cpu_layer.c (kernels/cpu_arch.h's lmi_arch_vec_*, _silu_*,
 * _bf16_binary): 16 lanes on AVX-512, 8 on AVX2, with the bf16 conversions of cpu_bf16.h lane by lane;
 * the loops are kernels/cpu_v8.h's (LMI_VEC_LOOPS). */
#include <stdint.h>

#include <immintrin.h>

#include "../cpu_arch.h"

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vneg(vf x) { return _mm512_sub_ps(_mm512_setzero_ps(), x); }    /* a sign flip for exp */
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vone(void) { return _mm512_set1_ps(1.0f); }

static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 floats -> bf16, f32_to_bf16's rounding (to nearest even; a NaN stays a NaN) lane by lane. */
static inline void vstore_bf16(uint16_t *p, vf x) {
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 vf;
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vneg(vf x) { return _mm256_xor_ps(_mm256_set1_ps(-0.0f), x); }     /* torch's neg() */
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vone(void) { return _mm256_set1_ps(1.0f); }

static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void vstore_bf16(uint16_t *p, vf x) {
    const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    /* |u| > inf's bits: a NaN (both sides below 2^31, so the signed compare is the unsigned one) */
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i v = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    /* every lane is below 2^16: the unsigned-saturating pack keeps it as is */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#else
#error "kernels/x86/ needs AVX2 and FMA at least (kernels/isa.py's avx2 or avx512 build)"
#endif

#define LMI_VEC_LOOPS
#include "../cpu_v8.h"
