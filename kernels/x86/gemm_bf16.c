/* The bf16 panel GEMMs' row blocks on x86 (kernels/cpu_arch.h's lmi_arch_bf16*; kernels/cpu_gemm_bf16.c
 * packs and drives). AVX-512F/BW: the widening kernels, up to 12 rows x 32 columns of fp32 accumulators
 * in 24 zmm registers; with AVX512-BF16 also the vdpbf16ps kernels (up to 14 rows) and the fp32 -> bf16
 * row rounding (vcvtne2ps2bf16). AVX2+FMA: kernels/cpu_v8.h's widening blocks of up to 2 rows, the same
 * values bit for bit; no vdpbf16ps kernels (lmi_arch_bf16_rows() is 0). */
#include <stdint.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MRMAX 14     /* vdpbf16ps kernels; the widening ones take up to MRW rows */
#define MRW 12

/* fp32 -> bf16 bits, round to nearest even as cpu_bf16.h's f32_to_bf16 (NaN stays NaN), 16 lanes. */
static inline __m256i round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* The epilogue of a row block: + bias, stored as fp32 or rounded to bf16. */
#define STORE(MR) \
        const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);                 \
        const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0                                 \
                                                  : (__mmask16)((1u << (ncols - 16)) - 1);          \
        if (bias) {                                                                                 \
            const __m512 bb0 = _mm512_maskz_loadu_ps(m0, bias), bb1 = _mm512_maskz_loadu_ps(m1, bias + 16); \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                        \
                c0[r] = _mm512_add_ps(c0[r], bb0);                                                  \
                c1[r] = _mm512_add_ps(c1[r], bb1);                                                  \
            }                                                                                       \
        }                                                                                           \
        if (out_bf16) {                                                                             \
            uint16_t *o = (uint16_t *)C;                                                            \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                _mm256_mask_storeu_epi16(o + r * ldc, m0, round_bf16(c0[r]));                       \
                _mm256_mask_storeu_epi16(o + r * ldc + 16, m1, round_bf16(c1[r]));                  \
            }                                                                                       \
        } else {                                                                                    \
            float *o = (float *)C;                                                                  \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                _mm512_mask_storeu_ps(o + r * ldc, m0, c0[r]);                                      \
                _mm512_mask_storeu_ps(o + r * ldc + 16, m1, c1[r]);                                 \
            }                                                                                       \
        }


/* The same panels widened in registers: A fp32 (row stride lda); each 32-bit lane of a panel load
 * holds one column's pair, whose k = 2q value is the lane shifted left 16 bits and whose k = 2q+1
 * value is the lane's high half, both exact in fp32; two fp32 FMAs per pair and column, in k
 * order from 0: every output is kernels/cpu_gemm.c's over the widened weight, bit for bit, at half
 * its weight bytes (two integer ops per 16 columns and pair ride along). */
#define KERNELW(MR)                                                                                 \
    static void kfw_##MR(const float *A, int64_t lda, const uint16_t *B, int64_t K, void *C,        \
                         int64_t ldc, int out_bf16, const float *bias, int64_t ncols,               \
                         const uint16_t *Bn, int64_t pf0, int64_t pfs) {                            \
        __m512 c0[MR], c1[MR];                                                                      \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            c0[r] = _mm512_setzero_ps();                                                            \
            c1[r] = _mm512_setzero_ps();                                                            \
        }                                                                                           \
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);                                     \
        const int64_t kq = (K + 1) / 2, kfull = K / 2;                                              \
        int64_t pfq = Bn ? pf0 : kq;                                                                \
        for (int64_t q = 0; q < kfull; ++q) {                                                       \
            if (q == pfq) {                                                                         \
                _mm_prefetch((const char *)(Bn + q * NR * 2), _MM_HINT_T1);                         \
                _mm_prefetch((const char *)(Bn + q * NR * 2 + 32), _MM_HINT_T1);                    \
                pfq += pfs;                                                                         \
            }                                                                                       \
            const __m512i w0 = _mm512_loadu_si512((const void *)(B + q * NR * 2));                  \
            const __m512i w1 = _mm512_loadu_si512((const void *)(B + q * NR * 2 + 32));             \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 2), _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 2 + 32), _MM_HINT_T0);                   \
            const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));                       \
            const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));                       \
            const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));                        \
            const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));                        \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                const __m512 a = _mm512_set1_ps(A[r * lda + 2 * q]);                                \
                c0[r] = _mm512_fmadd_ps(a, e0, c0[r]);                                              \
                c1[r] = _mm512_fmadd_ps(a, e1, c1[r]);                                              \
            }                                                                                       \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                const __m512 a = _mm512_set1_ps(A[r * lda + 2 * q + 1]);                            \
                c0[r] = _mm512_fmadd_ps(a, o0, c0[r]);                                              \
                c1[r] = _mm512_fmadd_ps(a, o1, c1[r]);                                              \
            }                                                                                       \
        }                                                                                           \
        if (kfull < kq) {                                                                           \
            const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(                                \
                _mm512_loadu_si512((const void *)(B + kfull * NR * 2)), 16));                       \
            const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(                                \
                _mm512_loadu_si512((const void *)(B + kfull * NR * 2 + 32)), 16));                  \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                const __m512 a = _mm512_set1_ps(A[r * lda + K - 1]);                                \
                c0[r] = _mm512_fmadd_ps(a, e0, c0[r]);                                              \
                c1[r] = _mm512_fmadd_ps(a, e1, c1[r]);                                              \
            }                                                                                       \
        }                                                                                           \
        STORE(MR)                                                                                   \
    }
KERNELW(1) KERNELW(2) KERNELW(3) KERNELW(4) KERNELW(5) KERNELW(6)
KERNELW(7) KERNELW(8) KERNELW(9) KERNELW(10) KERNELW(11) KERNELW(12)

typedef void (*kfw_t)(const float *, int64_t, const uint16_t *, int64_t, void *, int64_t, int,
                      const float *, int64_t, const uint16_t *, int64_t, int64_t);
static const kfw_t KFW[MRW + 1] = {0, kfw_1, kfw_2, kfw_3, kfw_4, kfw_5, kfw_6,
                                     kfw_7, kfw_8, kfw_9, kfw_10, kfw_11, kfw_12};

int lmi_arch_bf16w_rows(void) { return MRW; }

void lmi_arch_bf16w_block(const float *A, int64_t lda, const uint16_t *B, int64_t K, void *C, int64_t ldc,
                          int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn, int64_t pf0,
                          int64_t pfs, int64_t rows) {
    KFW[rows](A, lda, B, K, C, ldc, out_bf16, bias, ncols, Bn, pf0, pfs);
}

#if defined(__AVX512BF16__)
int lmi_arch_bf16_rows(void) { return MRMAX; }

/* a [K] fp32 -> o [K] bf16 (round to nearest even, denormals to zero) */
void lmi_arch_bf16_round_row(const float *a, int64_t K, uint16_t *o) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(a + k));
        _mm512_storeu_si512((void *)(o + k), (__m512i)v);
    }
    if (k < K) {
        const int64_t r = K - k;
        const __mmask16 lo = r >= 16 ? 0xFFFF : (__mmask16)((1u << r) - 1);
        const __mmask16 hi = r <= 16 ? 0 : (__mmask16)((1u << (r - 16)) - 1);
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, a + k + 16),
                                               _mm512_maskz_loadu_ps(lo, a + k));
        const __mmask32 all = r >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << r) - 1);
        _mm512_mask_storeu_epi16((void *)(o + k), all, (__m512i)v);
    }
}

/* Named accumulators (c0_r, c1_r for rows r < MR, `mr` the kernel's MR as a constant) and
 * vdpbf16ps by inline asm on the accumulator's own register: written as arrays of
 * _mm512_dpbf16_ps, gcc 12 copied every accumulator through the stack around each instruction
 * (the builtin has one form, and the allocator gives acc another register), as it did for the
 * int8 kernel's vpdpbusd (kernels/cpu_gemm_i8.c). */
#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)
#define DPBF16(acc, a, b) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define BF_DECL(r) __m512 c0_##r = _mm512_setzero_ps(), c1_##r = _mm512_setzero_ps();
#define BF_STEP(r)                                                                                  \
    if (mr > r) {                                                                                   \
        const __m512i a = _mm512_set1_epi32(*(const int32_t *)(A + r * lda + 2 * q));               \
        DPBF16(c0_##r, a, b0);                                                                      \
        DPBF16(c1_##r, a, b1);                                                                      \
    }
#define BF_LAST(r)                                                                                  \
    if (mr > r) {                                                                                   \
        const __m512i a = _mm512_set1_epi32((int32_t)A[r * lda + K - 1]);                           \
        DPBF16(c0_##r, a, b0);                                                                      \
        DPBF16(c1_##r, a, b1);                                                                      \
    }
#define BF_PUT(r)                                                                                   \
    if (mr > r) {                                                                                   \
        c0[r] = c0_##r;                                                                             \
        c1[r] = c1_##r;                                                                             \
    }

/* MR rows of A (bf16, row stride lda) x one panel B [kq][32][2] -> C (row stride ldc, fp32 or
 * bf16 by out_bf16), ncols <= 32 of them stored. Bn (or NULL): the next panel; this row block
 * prefetches its pairs pf0, pf0 + pfs, ... into L2, so the panel's row blocks share the prefetching. */
#define KERNEL(MR)                                                                                  \
    static void kbf_##MR(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t K, void *C,     \
                         int64_t ldc, int out_bf16, const float *bias, int64_t ncols,               \
                         const uint16_t *Bn, int64_t pf0, int64_t pfs) {                            \
        enum { mr = MR };                                                                           \
        FOR_ROWS(BF_DECL)                                                                           \
        const int64_t kq = (K + 1) / 2, kfull = K / 2;                                              \
        int64_t pfq = Bn ? pf0 : kq;                                                                \
        for (int64_t q = 0; q < kfull; ++q) {                                                       \
            if (q == pfq) {                                                                         \
                _mm_prefetch((const char *)(Bn + q * NR * 2), _MM_HINT_T1);                         \
                _mm_prefetch((const char *)(Bn + q * NR * 2 + 32), _MM_HINT_T1);                    \
                pfq += pfs;                                                                         \
            }                                                                                       \
            const __m512i b0 = _mm512_loadu_si512((const void *)(B + q * NR * 2));                  \
            const __m512i b1 = _mm512_loadu_si512((const void *)(B + q * NR * 2 + 32));             \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 2), _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 2 + 32), _MM_HINT_T0);                   \
            FOR_ROWS(BF_STEP)                                                                       \
        }                                                                                           \
        if (kfull < kq) { /* odd K: the last value alone, its pair's other half 0 */                \
            if (Bn) {                                                                               \
                _mm_prefetch((const char *)(Bn + kfull * NR * 2), _MM_HINT_T1);                     \
                _mm_prefetch((const char *)(Bn + kfull * NR * 2 + 32), _MM_HINT_T1);                \
            }                                                                                       \
            const __m512i b0 = _mm512_loadu_si512((const void *)(B + kfull * NR * 2));              \
            const __m512i b1 = _mm512_loadu_si512((const void *)(B + kfull * NR * 2 + 32));         \
            FOR_ROWS(BF_LAST)                                                                       \
        }                                                                                           \
        __m512 c0[MRMAX], c1[MRMAX];                                                                \
        FOR_ROWS(BF_PUT)                                                                            \
        STORE(MR)                                                                                   \
    }
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)
KERNEL(7) KERNEL(8) KERNEL(9) KERNEL(10) KERNEL(11) KERNEL(12) KERNEL(13) KERNEL(14)

typedef void (*kbf_t)(const uint16_t *, int64_t, const uint16_t *, int64_t, void *, int64_t, int,
                      const float *, int64_t, const uint16_t *, int64_t, int64_t);
static const kbf_t KBF[MRMAX + 1] = {0, kbf_1, kbf_2, kbf_3, kbf_4, kbf_5, kbf_6,
                                     kbf_7, kbf_8, kbf_9, kbf_10, kbf_11, kbf_12, kbf_13, kbf_14};

void lmi_arch_bf16_block(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t K, void *C, int64_t ldc,
                          int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn, int64_t pf0,
                          int64_t pfs, int64_t rows) {
    KBF[rows](A, lda, B, K, C, ldc, out_bf16, bias, ncols, Bn, pf0, pfs);
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define LMI_V8_BF16W
#include "../cpu_v8.h"

int lmi_arch_bf16w_rows(void) { return V8_BF16W_ROWS; }

void lmi_arch_bf16w_block(const float *A, int64_t lda, const uint16_t *B, int64_t K, void *C, int64_t ldc,
                          int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn, int64_t pf0,
                          int64_t pfs, int64_t rows) {
    V8_BF16W[rows](A, lda, B, K, C, ldc, out_bf16, bias, ncols, Bn, pf0, pfs);
}
#else
#error "kernels/x86/ needs AVX2 and FMA at least (kernels/isa.py's avx2 or avx512 build)"
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__))
int lmi_arch_bf16_rows(void) { return 0; }

void lmi_arch_bf16_round_row(const float *a, int64_t K, uint16_t *o) { (void)a; (void)K; (void)o; }

void lmi_arch_bf16_block(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t K, void *C, int64_t ldc,
                          int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn, int64_t pf0,
                          int64_t pfs, int64_t rows) {
    (void)A; (void)lda; (void)B; (void)K; (void)C; (void)ldc; (void)out_bf16; (void)bias; (void)ncols; (void)Bn;
    (void)pf0; (void)pfs; (void)rows;
}
#endif
