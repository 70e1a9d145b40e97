/* The int8 GEMM's x86 kernels (kernels/cpu_arch.h's lmi_arch_i8_*; kernels/cpu_gemm_i8.c quantizes the
 * rows, packs and drives). AVX-512 with VNNI: vpdpbusd, up to 14 rows x 32 columns of int32
 * accumulators in 28 zmm registers. AVX2 (the avx2 build, and an avx512 build on a CPU without VNNI):
 * with AVX-VNNI (-mavxvnni) vpdpbusd on ymm over kernels/cpu_v8.h's 8-column blocks of up to 3 rows;
 * without, vpmaddwd over the activations widened to int16 per chunk (lmi_arch_i8_widened()), a one-row
 * kernel by vpmaddubsw. Every path computes the same int32 sums and the same fp32 epilogue, so the
 * same values bit for bit (and lmi_arch_i8_absmax / _quant the same bytes as every build). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32
#define MRMAX 14

#if !defined(__AVX512F__)
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
#endif

#if defined(__AVX512F__)
/* The max of |a[k]|, k < n (a multiple of 16), 16 lanes at a time, reduced in the order of gcc's
 * _mm512_reduce_max_ps (every build: the same value, even for a NaN); 0 for n = 0. */
float lmi_arch_i8_absmax(const float *a, int64_t n) {
    float amax = 0.f;
    int64_t k = 0;
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= n; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(a + k)));
    amax = _mm512_reduce_max_ps(vmax);
    return amax;
}

/* o[k] = clamp(round_even(a[k] * inv), -127, 127) + 128 for k < n (a multiple of 16). */
void lmi_arch_i8_quant(const float *a, int64_t n, float inv, uint8_t *o) {
    /* the same values as the scalar loop: a * inv rounded to nearest even (vcvtps2dq under the
     * default rounding mode, as nearbyintf), then clamped */
    int64_t k = 0;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
    for (; k + 16 <= n; k += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(a + k), vinv));
        q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
        _mm_storeu_si128((__m128i *)(o + k), _mm512_cvtepi32_epi8(q));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The max of |a[k]|, k < n (a multiple of 16), 16 lanes at a time, reduced in the order of gcc's
 * _mm512_reduce_max_ps (every build: the same value, even for a NaN); 0 for n = 0. */
float lmi_arch_i8_absmax(const float *a, int64_t n) {
    float amax = 0.f;
    int64_t k = 0;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_setzero_ps();
    for (; k + 16 <= n; k += 16) {
        vlo = _mm256_max_ps(vlo, _mm256_and_ps(_mm256_loadu_ps(a + k), absm));
        vhi = _mm256_max_ps(vhi, _mm256_and_ps(_mm256_loadu_ps(a + k + 8), absm));
    }
    amax = i8_reduce_max16(vlo, vhi);
    return amax;
}

/* o[k] = clamp(round_even(a[k] * inv), -127, 127) + 128 for k < n (a multiple of 16). */
void lmi_arch_i8_quant(const float *a, int64_t n, float inv, uint8_t *o) {
    int64_t k = 0;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; k + 16 <= n; k += 16) {
        /* 1..255 each: the saturating packs are exact */
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(i8_quant8(a + k, vinv),
                                                                      i8_quant8(a + k + 8, vinv)), 0xD8);
        _mm_storeu_si128((__m128i *)(o + k), _mm_packus_epi16(_mm256_castsi256_si128(w),
                                                              _mm256_extracti128_si256(w, 1)));
    }
}
#else
#error "kernels/x86/ needs AVX2 and FMA at least (kernels/isa.py's avx2 or avx512 build)"
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
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

int lmi_arch_i8_rows(void) { return MRMAX; }

void lmi_arch_i8_block(const lmi_i8_args *c, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const int8_t *B = c->Bp + p * c->kq * NR * 4;
    KI8[rows](lmi_i8_row(c, row), c->A.ldp_bytes, B, c->kq, c->C + row * c->ldc + p * NR, c->ldc, c->sa + row,
                c->sw + p * NR, c->wsum + p * NR, c->bias ? c->bias + p * NR : 0,
                c->N - p * NR < NR ? c->N - p * NR : NR, next ? B + c->kq * NR * 4 : 0, i, nb);
}

int lmi_arch_i8_widened(void) { return 0; }

void lmi_arch_i8_widen(const uint8_t *Aq, int64_t rows, int64_t Kp, int16_t *out, int64_t ldo) {
    (void)Aq; (void)rows; (void)Kp; (void)out; (void)ldo;
}
#else
/* AVX2 (and AVX-512 builds without VNNI): the same panels, the same integers, the same epilogue,
 * fma(float(acc) * sw[n], sa[m], bias[n] or 0) per element. */
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

#ifdef I8_GENERIC
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
 * benchmarks/archive/i8_avx2_loops.c).
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

/* Aq [rows][Kp] (uint8, q + 128) -> out [rows][Kp] int16 at a row stride of ldo, each k-group (q0, q2, q1, q3). */
static void i8_widen_rows(const uint8_t *Aq, int64_t rows, int64_t Kp, int16_t *out, int64_t ldo) {
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                           0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m256i off = _mm256_set1_epi16(128);
    for (int64_t m = 0; m < rows; ++m) {
        const uint8_t *a = Aq + m * Kp;
        int16_t *o = out + m * ldo;
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

int lmi_arch_i8_rows(void) { return MRW; }
int lmi_arch_i8_widened(void) { return 1; }
void lmi_arch_i8_widen(const uint8_t *Aq, int64_t rows, int64_t Kp, int16_t *out, int64_t ldo) {
    i8_widen_rows(Aq, rows, Kp, out, ldo);
}

/* One row: ks_1 over Aq; more: blocks of 2-3 rows x half panels over the chunk's widened rows
 * (c->A16, row % c->chunk), the panel's column halves sharing its prefetch. */
void lmi_arch_i8_block(const lmi_i8_args *c, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const int64_t kq = c->kq, ncols = c->N - p * NR < NR ? c->N - p * NR : NR;
    const int8_t *B = c->Bp + p * kq * NR * 4, *Bn = next ? B + kq * NR * 4 : 0;
    float *C = c->C + row * c->ldc + p * NR;
    if (rows == 1) {    /* a chunk of one row (M = 1, or the last chunk) */
        ks_1(lmi_i8_row(c, row), B, kq, C, c->sa + row, c->sw + p * NR, c->bias ? c->bias + p * NR : 0, ncols, Bn, i,
             nb);
        return;
    }
    const int16_t *A = c->A16 + (row % c->chunk) * c->lda16;
    for (int64_t h = 0; h < 2 && ncols > 16 * h; ++h)
        KW[rows](A, c->lda16, B + 64 * h, kq, C + 16 * h, c->ldc, c->sa + row, c->sw + p * NR + 16 * h,
                 c->bias ? c->bias + p * NR + 16 * h : 0, ncols - 16 * h, Bn, i + nb * h, 2 * nb);
}
#endif
#endif
