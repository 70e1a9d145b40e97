/* int8 GEMM for CPU linear layers (option.quantize=int8): C[M, N] = dequant(A_q[M, K] @ W_q^T) (+ bias).
 *
 * Weights: int8 per output channel (symmetric, scale sw[n] = max|W[n, :]| / 127), packed once into
 * panels of 32 output columns and groups of 4 k: [ceil(N/32)][ceil(K/4)][32][4] int8, zero padded
 * (lmi_pack_i8). Activations: each row quantized per step to int8 by its own scale
 * (sa[m] = max|A[m, :]| / 127, round to nearest even), stored +128 as uint8 (lmi_quant_rows),
 * because VNNI's vpdpbusd multiplies unsigned by signed bytes: 4 u8 x 4 s8 products summed into
 * each int32 lane, 64 multiply-adds per instruction against 16 fp32 FMAs. The +128 is taken back
 * per column: acc - 128 * sum_k W_q[n, k] (wsum, from packing).
 *
 *   C[m, n] = sa[m] * sw[n] * (sum_k (A_q[m, k] + 128) W_q[n, k] - 128 wsum[n]) + bias[n]
 *
 * The integer sum is exact (|acc| < 2^31 for K < 2^16), so a row's result depends only on that row.
 * Same shape as kernels/cpu_gemm.c: up to 14 rows x 32 columns of int32 accumulators in 28 zmm
 * registers, each thread a contiguous range of panels, the next panel prefetched into L2 while
 * the current one multiplies; the weight stream is a quarter of fp32's.
 *
 * Builds (kernels/isa.py): avx512 with VNNI as above; AVX2+FMA (the avx2 build, and an avx512 build
 * on a CPU without VNNI) with vpmaddubsw/vpmaddwd on 8 columns per instruction, up to 2 rows; NEON
 * (armv8.2-a dotprod) with sdot, up to 3 rows. All share lmi_pack_i8's panels and compute the same
 * int32 sums and the same fp32 epilogue, so every build gives the avx512 build's values bit for bit
 * (and lmi_quant_rows the same bytes). Elsewhere lmi_gemm_i8_available() returns 0 and the caller
 * dequantizes instead (handler/model/quant.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_panel.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#define NR 32
#define MRMAX 14

/* W [N, K] int8 row-major -> panels [ceil(N/32)][Kp/4][32][4] (Kp = K rounded up to 4), zero
 * padded; wsum[n] = sum_k W[n, k] (0 for padded columns). */
void lmi_pack_i8(const int8_t *W, int64_t N, int64_t K, int8_t *out, int32_t *wsum) {
    const int64_t np = (N + NR - 1) / NR, kq = (K + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; ++p)
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t n = p * NR + j;
            int32_t s = 0;
            for (int64_t q = 0; q < kq; ++q)
                for (int64_t i = 0; i < 4; ++i) {
                    const int64_t k = q * 4 + i;
                    const int8_t v = (n < N && k < K) ? W[n * K + k] : 0;
                    out[((p * kq + q) * NR + j) * 4 + i] = v;
                    s += v;
                }
            if (n < N) wsum[n] = s;
        }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The max of 16 lanes (lo: lanes 0-7, hi: 8-15) in the order of gcc's _mm512_reduce_max_ps, so
 * even a NaN picks the same lane as the AVX-512 build (maxps returns its second operand then). */
static inline float i8_reduce_max16(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_max_ps(hi, lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
    return _mm_cvtss_f32(t10);
}
/* 8 lanes of a * inv rounded to nearest even (vcvtps2dq), clamped to [-127, 127], + 128. */
static inline __m256i i8_quant8(const float *a, __m256 vinv) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a), vinv));
    return _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127)),
                            _mm256_set1_epi32(128));
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
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
#endif

/* A [M, K] fp32 at row stride lda -> out [M, Kp] uint8 (q + 128, zero padded: padding is 128,
 * i.e. q = 0) and scales [M] (0 for an all-zero row). Every build writes the same bytes: 16 lanes
 * at a time (AVX-512: one vector; AVX2: two; NEON: four), the max reduced in one order, the rest
 * of the row by the scalar loop. */
void lmi_quant_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint8_t *out, int64_t Kp,
                    float *scales, int nthreads) {
    /* no more threads than rows: a decode step's one row wakes no other thread */
    const int nt = M < 1 || nthreads < 1 ? 1 : M < nthreads ? (int)M : nthreads;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t m = 0; m < M; ++m) {
        const float *a = A + m * lda;
        uint8_t *o = out + m * Kp;
        float amax = 0.f;
        int64_t k = 0;
#if defined(__AVX512F__)
        /* 16 lanes at a time; the same values as the scalar loop: a * inv rounded to nearest
         * even (vcvtps2dq under the default rounding mode, as nearbyintf), then clamped. */
        __m512 vmax = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(a + k)));
        amax = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            vlo = _mm256_max_ps(vlo, _mm256_and_ps(_mm256_loadu_ps(a + k), absm));
            vhi = _mm256_max_ps(vhi, _mm256_and_ps(_mm256_loadu_ps(a + k + 8), absm));
        }
        amax = i8_reduce_max16(vlo, vhi);
#elif defined(__ARM_NEON) && defined(__aarch64__)
        float32x4_t v0 = vdupq_n_f32(0.f), v1 = v0, v2 = v0, v3 = v0;
        for (; k + 16 <= K; k += 16) {
            v0 = i8_maxps(v0, vabsq_f32(vld1q_f32(a + k)));
            v1 = i8_maxps(v1, vabsq_f32(vld1q_f32(a + k + 4)));
            v2 = i8_maxps(v2, vabsq_f32(vld1q_f32(a + k + 8)));
            v3 = i8_maxps(v3, vabsq_f32(vld1q_f32(a + k + 12)));
        }
        amax = i8_reduce_max16(v0, v1, v2, v3);
#endif
        for (; k < K; ++k) {
            const float v = fabsf(a[k]);
            amax = v > amax ? v : amax;
        }
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        scales[m] = s;
        k = 0;
#if defined(__AVX512F__)
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
        for (; k + 16 <= K; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(a + k), vinv));
            q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
            _mm_storeu_si128((__m128i *)(o + k), _mm512_cvtepi32_epi8(q));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; k + 16 <= K; k += 16) {
            /* 1..255 each: the saturating packs are exact */
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(i8_quant8(a + k, vinv),
                                                                          i8_quant8(a + k + 8, vinv)), 0xD8);
            _mm_storeu_si128((__m128i *)(o + k), _mm_packus_epi16(_mm256_castsi256_si128(w),
                                                                  _mm256_extracti128_si256(w, 1)));
        }
#elif defined(__ARM_NEON) && defined(__aarch64__)
        const float32x4_t vinv = vdupq_n_f32(inv);
        for (; k + 16 <= K; k += 16) {
            const uint16x8_t w0 = vreinterpretq_u16_s16(vcombine_s16(vmovn_s32(i8_quant4(a + k, vinv)),
                                                                     vmovn_s32(i8_quant4(a + k + 4, vinv))));
            const uint16x8_t w1 = vreinterpretq_u16_s16(vcombine_s16(vmovn_s32(i8_quant4(a + k + 8, vinv)),
                                                                     vmovn_s32(i8_quant4(a + k + 12, vinv))));
            vst1q_u8(o + k, vcombine_u8(vmovn_u16(w0), vmovn_u16(w1)));
        }
#endif
        for (; k < K; ++k) {
            float q = nearbyintf(a[k] * inv);
            q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
            o[k] = (uint8_t)((int)q + 128);
        }
        for (k = K; k < Kp; ++k) o[k] = 128;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

int lmi_gemm_i8_available(void) { return 1; }

/* Named accumulators (c0_r, c1_r for rows r < MR), each row's code behind a compile-time `mr > r`:
 * written as arrays, gcc 12 kept them in memory (-O2: a load and a store around every vpdpbusd)
 * or spilled them (-O3), at 1.4x fp32's speed instead of the 2x+ that 4x the multiply-adds per
 * instruction allow. `mr` is each kernel's MR, a constant: the other rows' code is dropped. */
/* acc += a . b as one vpdpbusd on acc's own register: gcc 12's builtin copies the accumulator
 * between registers and the stack around each instruction (its one form leaves acc's register
 * to the allocator). */
#define DPBUSD(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)
#define DECL(r) __m512i c0_##r = _mm512_setzero_si512(), c1_##r = _mm512_setzero_si512();
#define STEP(r)                                                                                     \
    if (mr > r) {                                                                                   \
        const __m512i a = _mm512_set1_epi32(*(const int32_t *)(A + r * lda + q * 4));               \
        DPBUSD(c0_##r, a, b0);                                                                      \
        DPBUSD(c1_##r, a, b1);                                                                      \
    }
#define STORE(r)                                                                                    \
    if (mr > r) {                                                                                   \
        const __m512 a = _mm512_set1_ps(sa[r]);                                                     \
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(c0_##r, z0));                         \
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(c1_##r, z1));                         \
        _mm512_mask_storeu_ps(C + r * ldc, m0, _mm512_fmadd_ps(_mm512_mul_ps(v0, s0), a, bb0));     \
        _mm512_mask_storeu_ps(C + r * ldc + 16, m1, _mm512_fmadd_ps(_mm512_mul_ps(v1, s1), a, bb1)); \
    }

#define KERNEL(MR)                                                                                  \
    static void ki8_##MR(const uint8_t *A, int64_t lda, const int8_t *B, int64_t kq, float *C,      \
                         int64_t ldc, const float *sa, const float *sw, const int32_t *wsum,        \
                         const float *bias, int64_t ncols, const int8_t *Bn, int64_t pf0,           \
                         int64_t pfs) {                                                             \
        enum { mr = MR };                                                                           \
        FOR_ROWS(DECL)                                                                              \
        int64_t pfq = Bn ? pf0 : kq;                                                                \
        for (int64_t q = 0; q < kq; ++q) {                                                          \
            if (q == pfq) {                                                                         \
                _mm_prefetch((const char *)(Bn + q * NR * 4), _MM_HINT_T1);                         \
                _mm_prefetch((const char *)(Bn + q * NR * 4 + 64), _MM_HINT_T1);                    \
                pfq += pfs;                                                                         \
            }                                                                                       \
            const __m512i b0 = _mm512_loadu_si512((const void *)(B + q * NR * 4));                  \
            const __m512i b1 = _mm512_loadu_si512((const void *)(B + q * NR * 4 + 64));             \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 4), _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 4 + 64), _MM_HINT_T0);                   \
            FOR_ROWS(STEP)                                                                          \
        }                                                                                           \
        const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);                 \
        const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0                                 \
                                                  : (__mmask16)((1u << (ncols - 16)) - 1);          \
        const __m512i z0 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m0, wsum), 7);                \
        const __m512i z1 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m1, wsum + 16), 7);           \
        const __m512 s0 = _mm512_maskz_loadu_ps(m0, sw), s1 = _mm512_maskz_loadu_ps(m1, sw + 16);   \
        const __m512 bb0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();            \
        const __m512 bb1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();       \
        FOR_ROWS(STORE)                                                                             \
    }
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)
KERNEL(7) KERNEL(8) KERNEL(9) KERNEL(10) KERNEL(11) KERNEL(12) KERNEL(13) KERNEL(14)

typedef void (*ki8_t)(const uint8_t *, int64_t, const int8_t *, int64_t, float *, int64_t, const float *,
                      const float *, const int32_t *, const float *, int64_t, const int8_t *, int64_t, int64_t);
static const ki8_t KI8[MRMAX + 1] = {0, ki8_1, ki8_2, ki8_3, ki8_4, ki8_5, ki8_6,
                                     ki8_7, ki8_8, ki8_9, ki8_10, ki8_11, ki8_12, ki8_13, ki8_14};

#define MRB MRMAX
#define I8_TABLE_DRIVER

#elif (defined(__AVX2__) && defined(__FMA__)) || (defined(__ARM_NEON) && defined(__aarch64__))
/* AVX2 and NEON (and AVX-512 builds without VNNI): the same panels, the same integers, the same
 * epilogue. Each k-group of a panel is 4 units of 8 columns x 4 k (32 bytes); each unit adds a
 * row's 4-k dot product to 8 int32 lanes, and every path ends with sum_k q W_q[n, k] exactly.
 *
 *   AVX-VNNI (-mavxvnni): vpdpbusd on ymm, Aq x W_q, the +128 taken back by wsum as above; up to 3 rows.
 *   AVX2: int16 products by vpmaddwd (below, "AVX2 without VNNI"), the activations widened once
 *         per call; up to MRW rows x 16 columns.
 *   NEON: sdot (armv8.2-a dotprod), signed q = Aq - 128 (Aq ^ 0x80) x signed bytes summed 4 at a
 *         time into int32 lanes (no wsum correction); up to 3 rows.
 *
 * Epilogue per element as the AVX-512 kernel's: fma(float(acc) * sw[n], sa[m], bias[n] or 0). */
#include <omp.h>
#include <stdlib.h>

int lmi_gemm_i8_available(void) { return 1; }

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVXVNNI__) || defined(LMI_I8_CHECK_EVEX_VNNI)
/* AVX-VNNI (the avx2 build built with -mavxvnni): vpdpbusd on 8 columns, as the AVX-512 kernel on
 * 16: Aq (unsigned, +128) x W (signed), the +128 taken back by wsum in the epilogue. By inline asm
 * on the accumulator's own register (see DPBUSD above). LMI_I8_CHECK_EVEX_VNNI: the same operation
 * in its EVEX form (AVX512-VNNI/VL), to run this code on a CPU without AVX-VNNI in a check. */
#define I8_GENERIC 1
#define MRI 3               /* 4 accumulators a row: 12 + 3 broadcasts in 16 ymm registers */
#define I8_WSUM 1
#ifdef __AVXVNNI__
#define DPBUSD_Y(acc, a, b) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b))
#else
#define DPBUSD_Y(acc, a, b) __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b))
#endif
typedef __m256i i8row;      /* a row's 4 bytes Aq, broadcast */
typedef __m256i i8w;
static inline i8row i8row_load(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline i8w i8w_load(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256i i8_dot(__m256i acc, i8row a, i8w w) {
    DPBUSD_Y(acc, a, w);
    return acc;
}
#else
#define I8_WSUM 0
#endif
typedef __m256i i8acc;      /* 8 columns' int32 sums */
typedef __m256 i8f;
static inline i8acc i8acc_zero(void) { return _mm256_setzero_si256(); }
static inline __m256i i8_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline i8f i8f_load_n(const float *p, int n) {  /* the first n lanes, 0 past them */
    return n >= 8 ? _mm256_loadu_ps(p) : n > 0 ? _mm256_maskload_ps(p, i8_mask(n)) : _mm256_setzero_ps();
}
static inline void i8f_store_n(float *p, i8f v, int n) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else if (n > 0) _mm256_maskstore_ps(p, i8_mask(n), v);
}
/* acc - 128 wsum for the first n columns (where the sums took Aq = q + 128) */
static inline i8acc i8_unoffset(i8acc acc, const int32_t *wsum, int n) {
#if I8_WSUM
    const __m256i z = n >= 8 ? _mm256_loadu_si256((const __m256i *)wsum) : _mm256_maskload_epi32(wsum, i8_mask(n));
    return _mm256_sub_epi32(acc, _mm256_slli_epi32(z, 7));
#else
    (void)wsum, (void)n;
    return acc;
#endif
}
/* fma(float(acc) * s, a, b), rounded as the AVX-512 epilogue rounds */
static inline i8f i8_epilogue(i8acc acc, i8f s, float a, i8f b) {
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), s), _mm256_set1_ps(a), b);
}
#else
#define I8_GENERIC 1
#define MRI 3               /* 8 int32x4 accumulators per row in 32 q registers */
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
#endif

#ifdef I8_GENERIC
/* MR rows of Aq (row stride lda) x one panel B [kq][32][4] -> C (row stride ldc), ncols <= 32 of
 * them stored. Bn (or NULL): the next panel, whose k-groups pf0, pf0 + pfs, ... this row block
 * prefetches into L2 (the panel's row blocks share the prefetching). Named accumulators, each
 * row's code behind a compile-time `mr > r` (as arrays, gcc 12 kept some on the stack). */
#define FOR_ROWS3(X) X(0) X(1) X(2)
#define DECL(r) i8acc c##r##_0 = i8acc_zero(), c##r##_1 = c##r##_0, c##r##_2 = c##r##_0, c##r##_3 = c##r##_0; \
                i8row a##r;
#define LOADA(r) if (mr > r) a##r = i8row_load(A + r * lda + q * 4);
#define DOT(r, j) if (mr > r) c##r##_##j = i8_dot(c##r##_##j, a##r, w);
#define DOT0(r) DOT(r, 0)
#define DOT1(r) DOT(r, 1)
#define DOT2(r) DOT(r, 2)
#define DOT3(r) DOT(r, 3)
#define OUT(r, j)                                                                                     \
    if (mr > r) i8f_store_n(C + r * ldc + 8 * j, i8_epilogue(i8_unoffset(c##r##_##j, wsum + 8 * j, n), s, sa[r], bb), n);
#define OUT0(r) OUT(r, 0)
#define OUT1(r) OUT(r, 1)
#define OUT2(r) OUT(r, 2)
#define OUT3(r) OUT(r, 3)
#define UNIT(j)                                                                                       \
    {                                                                                                 \
        const i8w w = i8w_load(b + j * 32);                                                           \
        FOR_ROWS3(DOT##j)                                                                             \
    }
#define EPI(j)                                                                                        \
    if (ncols > 8 * j) {                                                                              \
        const int n = ncols - 8 * j >= 8 ? 8 : (int)(ncols - 8 * j);                                  \
        const i8f s = i8f_load_n(sw + 8 * j, n), bb = i8f_load_n(bias ? bias + 8 * j : 0, bias ? n : 0); \
        FOR_ROWS3(OUT##j)                                                                             \
    }

#define KERNEL(MR)                                                                                    \
    static void ki8_##MR(const uint8_t *A, int64_t lda, const int8_t *B, int64_t kq, float *C,        \
                         int64_t ldc, const float *sa, const float *sw, const int32_t *wsum,          \
                         const float *bias, int64_t ncols, const int8_t *Bn, int64_t pf0, int64_t pfs) { \
        enum { mr = MR };                                                                             \
        FOR_ROWS3(DECL)                                                                               \
        int64_t pfq = Bn ? pf0 : kq;                                                                  \
        for (int64_t q = 0; q < kq; ++q) {                                                            \
            const int8_t *b = B + q * NR * 4;                                                         \
            if (q == pfq) {                                                                           \
                __builtin_prefetch(Bn + q * NR * 4, 0, 2);                                            \
                __builtin_prefetch(Bn + q * NR * 4 + 64, 0, 2);                                       \
                pfq += pfs;                                                                           \
            }                                                                                         \
            __builtin_prefetch(b + 8 * NR * 4, 0, 3);                                                 \
            __builtin_prefetch(b + 8 * NR * 4 + 64, 0, 3);                                            \
            FOR_ROWS3(LOADA)                                                                          \
            UNIT(0) UNIT(1) UNIT(2) UNIT(3)                                                           \
        }                                                                                             \
        EPI(0) EPI(1) EPI(2) EPI(3)                                                                   \
    }
typedef void (*ki8_t)(const uint8_t *, int64_t, const int8_t *, int64_t, float *, int64_t, const float *,
                      const float *, const int32_t *, const float *, int64_t, const int8_t *, int64_t, int64_t);
KERNEL(1) KERNEL(2) KERNEL(3)
static const ki8_t KI8[MRI + 1] = {0, ki8_1, ki8_2, ki8_3};

#define MRB MRI
#define I8_TABLE_DRIVER
#else
/* AVX2 without VNNI: int16 products by vpmaddwd, exact for any int8 operands.
 *
 * Two rows or more: the activations are widened once per call to int16 q = Aq - 128, each
 * k-group's four stored as (q0, q2, q1, q3), so a row's k-group is two 32-bit broadcasts, (q0, q2)
 * and (q1, q3). A weight unit's 32 bytes (8 columns x 4 k) read as 16-bit words hold w0 | w1 << 8
 * and w2 | w3 << 8 per column: an arithmetic shift right by 8 gives (w1, w3) sign-extended, a
 * shift left by 8 and then right by 8 gives (w0, w2). vpmaddwd of each against its broadcast adds
 * two products into each column's int32 lane. Blocks of up to 3 rows x 16 columns (6 accumulators
 * and 6 broadcasts in 16 ymm registers), each panel in two column halves. Per row and unit (32
 * multiply-adds): 2 vpmaddwd + 2 vpaddd; the unit's 3 shifts are shared by the block's rows.
 *
 * One row (a decode step of one sequence): no widening pass, the vpmaddubsw route below (ks_1).
 *
 * |product| <= 128 x 128, so nothing saturates, and |sum| < 2^31 for K < 2^17: the sums are
 * sum_k q W_q, as the AVX-512 build's Aq W_q - 128 wsum are.
 *
 * Why not vpmaddubsw (unsigned x signed bytes into saturating int16 pairs): Aq x W_q pairs reach
 * 2 x 255 x 127 and saturate; |W| x (q with W's sign, vpsignb) is exact but costs a vpsignb per
 * row and unit before vpmaddubsw, vpmaddwd by ones and vpaddd, and on a Zen 4 vpsignb, vpmaddubsw,
 * vpmaddwd and the FMAs issue on the same two pipes: 3 of those 4 instructions queue there (about
 * 1.8 cycles per row and unit in a loop from L1, against 1.35 here and 2.2 for fp32's 4 FMAs:
 * benchmarks/i8_avx2_loops.c).
 * The sign moved to the weights (|q| x W with q's sign) is wrong for W = -128. */
#define MRW 3
static inline __m256i i8w_bcast(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#define FOR_ROWSW(X) X(0) X(1) X(2)
#define WDECL(r) __m256i c##r##_0 = _mm256_setzero_si256(), c##r##_1 = c##r##_0;
#define WLO(r, j) if (mr > r) c##r##_##j = _mm256_add_epi32(c##r##_##j, _mm256_madd_epi16(lo, i8w_bcast(a + r * lda)));
#define WHI(r, j) if (mr > r) c##r##_##j = _mm256_add_epi32(c##r##_##j, _mm256_madd_epi16(hi, i8w_bcast(a + r * lda + 2)));
#define WLO0(r) WLO(r, 0)
#define WLO1(r) WLO(r, 1)
#define WHI0(r) WHI(r, 0)
#define WHI1(r) WHI(r, 1)
#define WUNIT(j)                                                                                      \
    {                                                                                                 \
        const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 32 * j));                          \
        const __m256i lo = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);                             \
        FOR_ROWSW(WLO##j)                                                                             \
        const __m256i hi = _mm256_srai_epi16(w, 8);                                                   \
        FOR_ROWSW(WHI##j)                                                                             \
    }
#define WOUT(r, j) if (mr > r) i8f_store_n(C + r * ldc + 8 * j, i8_epilogue(c##r##_##j, s, sa[r], bb), n);
#define WOUT0(r) WOUT(r, 0)
#define WOUT1(r) WOUT(r, 1)
#define WEPI(j)                                                                                       \
    if (ncols > 8 * j) {                                                                              \
        const int n = ncols - 8 * j >= 8 ? 8 : (int)(ncols - 8 * j);                                  \
        const i8f s = i8f_load_n(sw + 8 * j, n), bb = i8f_load_n(bias ? bias + 8 * j : 0, bias ? n : 0); \
        FOR_ROWSW(WOUT##j)                                                                            \
    }
/* MR rows of the widened activations A (row stride lda int16s) x 2 units (16 columns) of a panel
 * from B (the panel's first byte plus 64 for its second half; k-groups NR * 4 bytes apart) -> C,
 * the first ncols (<= 16) stored. Bn (or NULL): the next panel's first byte; this call prefetches
 * its whole k-groups pf0, pf0 + pfs, ... into L2 (the panel's calls, every row block of both
 * halves, share the prefetching). */
#define KERNELW(MR)                                                                                   \
    static void kw_##MR(const int16_t *A, int64_t lda, const int8_t *B, int64_t kq, float *C,         \
                        int64_t ldc, const float *sa, const float *sw, const float *bias,             \
                        int64_t ncols, const int8_t *Bn, int64_t pf0, int64_t pfs) {                  \
        enum { mr = MR };                                                                             \
        FOR_ROWSW(WDECL)                                                                              \
        int64_t pfq = Bn ? pf0 : kq;                                                                  \
        for (int64_t q = 0; q < kq; ++q) {                                                            \
            const int8_t *b = B + q * NR * 4;                                                         \
            const int16_t *a = A + q * 4;                                                             \
            if (q == pfq) {                                                                           \
                __builtin_prefetch(Bn + q * NR * 4, 0, 2);                                            \
                __builtin_prefetch(Bn + q * NR * 4 + 64, 0, 2);                                       \
                pfq += pfs;                                                                           \
            }                                                                                         \
            __builtin_prefetch(b + 8 * NR * 4, 0, 3);                                                 \
            WUNIT(0) WUNIT(1)                                                                         \
        }                                                                                             \
        WEPI(0) WEPI(1)                                                                               \
    }
typedef void (*kw_t)(const int16_t *, int64_t, const int8_t *, int64_t, float *, int64_t, const float *,
                     const float *, const float *, int64_t, const int8_t *, int64_t, int64_t);
KERNELW(2) KERNELW(3)
static const kw_t KW[MRW + 1] = {0, 0, kw_2, kw_3};

/* One row of Aq (uint8, q + 128) x one whole panel -> C's first ncols (<= 32); Bn / pf0 / pfs as
 * above. vpmaddubsw of |W| (0..128 unsigned) by q with W's sign (vpsignb; q in -127..127 from
 * lmi_quant_rows): pair sums <= 2 x 128 x 127, never saturated; vpmaddwd by ones into int32.
 * With one row nothing is shared across rows, and this measured faster than the int16 route
 * (vpmovsxbw units against a 64-bit broadcast: 0.9x) on weights streamed from L3. */
__attribute__((noinline)) static void ks_1(const uint8_t *A, const int8_t *B, int64_t kq, float *C, const float *sa,
                                           const float *sw, const float *bias, int64_t ncols, const int8_t *Bn,
                                           int64_t pf0, int64_t pfs) {
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
    const __m256i ones = _mm256_set1_epi16(1), x80 = _mm256_set1_epi8((char)0x80);
    int64_t pfq = Bn ? pf0 : kq;
    for (int64_t q = 0; q < kq; ++q) {
        const int8_t *b = B + q * NR * 4;
        if (q == pfq) {
            __builtin_prefetch(Bn + q * NR * 4, 0, 2);
            __builtin_prefetch(Bn + q * NR * 4 + 64, 0, 2);
            pfq += pfs;
        }
        __builtin_prefetch(b + 8 * NR * 4, 0, 3);
        __builtin_prefetch(b + 8 * NR * 4 + 64, 0, 3);
        int32_t v;
        memcpy(&v, A + q * 4, 4);
        const __m256i a = _mm256_xor_si256(_mm256_set1_epi32(v), x80);
#define S1(j, acc)                                                                                    \
    {                                                                                                 \
        const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 32 * j));                          \
        const __m256i pr = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));           \
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pr, ones));                                     \
    }
        S1(0, c0) S1(1, c1) S1(2, c2) S1(3, c3)
#undef S1
    }
    const __m256i acc[4] = {c0, c1, c2, c3};
    for (int j = 0; j < 4 && ncols > 8 * j; ++j) {
        const int n = ncols - 8 * j >= 8 ? 8 : (int)(ncols - 8 * j);
        const i8f s = i8f_load_n(sw + 8 * j, n), bb = i8f_load_n(bias ? bias + 8 * j : 0, bias ? n : 0);
        i8f_store_n(C + 8 * j, i8_epilogue(acc[j], s, sa[0], bb), n);
    }
}

/* Aq [rows][Kp] (uint8, q + 128) -> out [rows][Kp] int16, each k-group (q0, q2, q1, q3). */
static void i8_widen_rows(const uint8_t *Aq, int64_t rows, int64_t Kp, int16_t *out) {
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                           0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m256i off = _mm256_set1_epi16(128);
    for (int64_t m = 0; m < rows; ++m) {
        const uint8_t *a = Aq + m * Kp;
        int16_t *o = out + m * Kp;
        int64_t k = 0;
        for (; k + 16 <= Kp; k += 16) {
            const __m256i w = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(a + k))), off);
            _mm256_storeu_si256((__m256i *)(o + k), _mm256_shuffle_epi8(w, order));
        }
        for (; k < Kp; k += 4) {
            o[k] = (int16_t)(a[k] - 128), o[k + 1] = (int16_t)(a[k + 2] - 128);
            o[k + 2] = (int16_t)(a[k + 1] - 128), o[k + 3] = (int16_t)(a[k + 3] - 128);
        }
    }
}

typedef struct {
    const uint8_t *Aq;
    int16_t *A16;       /* the chunk's rows widened */
    const float *sa, *sw, *bias;
    const int8_t *Bp;
    float *C;
    int64_t Kp, kq, N, ldc, chunk;
} i8w_ctx;

static void i8w_prep(const void *v, int64_t row, int64_t rows, int t, int nt) {
    const i8w_ctx *c = (const i8w_ctx *)v;
    if (rows < 2) return;   /* one row: ks_1 reads Aq */
    const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
    i8_widen_rows(c->Aq + (row + r0) * c->Kp, r1 - r0, c->Kp, c->A16 + r0 * c->Kp);
}

static void i8w_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const i8w_ctx *c = (const i8w_ctx *)v;
    const int64_t kq = c->kq, ncols = c->N - p * NR < NR ? c->N - p * NR : NR;
    const int8_t *B = c->Bp + p * kq * NR * 4, *Bn = next ? B + kq * NR * 4 : 0;
    float *C = c->C + row * c->ldc + p * NR;
    if (rows == 1) {    /* a chunk of one row (M = 1, or the last chunk) */
        ks_1(c->Aq + row * c->Kp, B, kq, C, c->sa + row, c->sw + p * NR, c->bias ? c->bias + p * NR : 0, ncols,
             Bn, i, nb);
        return;
    }
    const int16_t *A = c->A16 + (row % c->chunk) * c->Kp;
    for (int64_t h = 0; h < 2 && ncols > 16 * h; ++h)   /* the panel's column halves share its prefetch */
        KW[rows](A, c->Kp, B + 64 * h, kq, C + 16 * h, c->ldc, c->sa + row, c->sw + p * NR + 16 * h,
                 c->bias ? c->bias + p * NR + 16 * h : 0, ncols - 16 * h, Bn, i + nb * h, 2 * nb);
}

/* As the AVX-512 lmi_gemm_i8 (kernels/cpu_panel.h's loop): one row by ks_1; more in blocks of 2-3
 * rows x half panels over the activations widened chunk by chunk into one buffer the threads share. */
void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp,
                 const int32_t *wsum, const float *sw, int64_t N, const float *bias, float *C, int64_t ldc,
                 int nthreads) {
    (void)wsum;
    int64_t chunk = lmi_panel_chunk(2 * Kp, MRW);
    if (chunk > M) chunk = M;
    int16_t *A16 = 0;
    if (M > 1) {
        while (!(A16 = (int16_t *)malloc((size_t)(chunk * Kp) * sizeof(int16_t))) && chunk > 2) chunk = (chunk + 1) / 2;
        if (!A16) {     /* not even two rows' 4 Kp bytes: the same sums, one row at a time */
            for (int64_t m = 0; m < M; ++m)
                lmi_gemm_i8(Aq + m * Kp, 1, Kp, sa + m, Bp, wsum, sw, N, bias, C + m * ldc, ldc, nthreads);
            return;
        }
    }
    const i8w_ctx c = {Aq, A16, sa, sw, bias, Bp, C, Kp, Kp / 4, N, ldc, chunk > 0 ? chunk : 1};
    lmi_panel_drive(M, (N + NR - 1) / NR, c.chunk, MRW, nthreads, i8w_block, i8w_prep, &c);
    free(A16);
}
#endif
#else
int lmi_gemm_i8_available(void) { return 0; }

void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp,
                 const int32_t *wsum, const float *sw, int64_t N, const float *bias, float *C, int64_t ldc,
                 int nthreads) {
    (void)Aq; (void)M; (void)Kp; (void)sa; (void)Bp; (void)wsum; (void)sw; (void)N; (void)bias; (void)C;
    (void)ldc; (void)nthreads;
}
#endif

#ifdef I8_TABLE_DRIVER
typedef struct {
    const uint8_t *Aq;
    const float *sa, *sw, *bias;
    const int8_t *Bp;
    const int32_t *wsum;
    float *C;
    int64_t Kp, kq, N, ldc;
} i8_ctx;

static void i8_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const i8_ctx *c = (const i8_ctx *)v;
    const int8_t *B = c->Bp + p * c->kq * NR * 4;
    KI8[rows](c->Aq + row * c->Kp, c->Kp, B, c->kq, c->C + row * c->ldc + p * NR, c->ldc, c->sa + row, c->sw + p * NR,
              c->wsum + p * NR, c->bias ? c->bias + p * NR : 0, c->N - p * NR < NR ? c->N - p * NR : NR,
              next ? B + c->kq * NR * 4 : 0, i, nb);
}

/* Aq [M, Kp] uint8 from lmi_quant_rows with its scales sa [M]; Bp, wsum from lmi_pack_i8; sw [N]
 * the weight scales; bias [N] or NULL; C [M, N] fp32 at row stride ldc (kernels/cpu_panel.h's
 * loop over this build's row blocks of up to MRB rows). */
void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp,
                 const int32_t *wsum, const float *sw, int64_t N, const float *bias, float *C, int64_t ldc,
                 int nthreads) {
    const i8_ctx c = {Aq, sa, sw, bias, Bp, wsum, C, Kp, Kp / 4, N, ldc};
    lmi_panel_drive(M, (N + NR - 1) / NR, lmi_panel_chunk(Kp, MRB), MRB, nthreads, i8_block, 0, &c);
}
#endif
