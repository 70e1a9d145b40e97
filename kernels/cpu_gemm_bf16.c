/* bf16 GEMM for CPU linear layers of bf16 models: C[M, N] = A[M, K] @ W^T (+ bias), A and W bf16,
 * the sum in fp32, C fp32 or bf16 (rounded to nearest even once, as torch rounds).
 *
 * Weights: W [N, K] (nn.Linear's bf16 weight) packed once into panels of 32 output columns whose
 * k run in pairs: [ceil(N/32)][ceil(K/2)][32][2] bf16, zero padded (odd K: the last pair's second
 * value is 0). AVX512-BF16's vdpbf16ps takes, per fp32 lane j, one pair of A (A[m, 2q], A[m, 2q+1],
 * broadcast to every lane) and lane j's pair of the panel, and adds both exact products to the
 * lane's fp32 accumulator: 32 multiply-adds per instruction against 16 fp32 FMAs, and half the
 * bytes of the widened fp32 panels (kernels/cpu_gemm.c) to stream per step.
 *
 *   C[m, n] = round(sum over pairs q of (A[m, 2q] W[n, 2q] + A[m, 2q+1] W[n, 2q+1]) + bias[n])
 *
 * (each pair added in the instruction's own order; the hardware treats bf16 denormals as zero.)
 * A bf16 row is already pairs along k: no copy; an odd K's last value is loaded alone (the pair's
 * other half zero, never the next row's value). An fp32 A is first rounded to bf16 rows by
 * vcvtne2ps2bf16 (lmi_bf16_rows; round to nearest even, denormals to zero).
 *
 * Same shape as kernels/cpu_gemm.c: up to 14 rows (12 widening) x 32 columns of fp32 accumulators in
 * 28 (24) zmm registers, each thread a contiguous range of panels, the next panel prefetched into L2 while
 * the current one multiplies, rows in chunks whose A slice stays in L2. A row's result depends
 * only on that row.
 *
 * Needs AVX512-BF16 (the avx512 build, -march=native); elsewhere lmi_gemm_bf16_available() returns 0
 * and the caller keeps oneDNN or the widened panels (handler/model/cpu.py). The widened kernels
 * (lmi_gemm_bf16w) run on AVX-512F/BW, AVX2+FMA and aarch64 NEON builds, with the same values on
 * each (kernels/cpu_gemm.c's over the widened weight).
 */
#include <stdint.h>

#include "cpu_api.h"
#include "cpu_panel.h"

#define NR 32
#define MRMAX 14     /* vdpbf16ps kernels; the widening ones take up to MRW rows */
#define MRW 12

/* W [N, K] bf16 row-major -> panels [ceil(N/32)][ceil(K/2)][32][2], zero padded. */
void lmi_pack_bf16(const uint16_t *W, int64_t N, int64_t K, uint16_t *out) {
    const int64_t np = (N + NR - 1) / NR, kq = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; ++p)
        for (int64_t q = 0; q < kq; ++q)
            for (int64_t j = 0; j < NR; ++j)
                for (int64_t i = 0; i < 2; ++i) {
                    const int64_t n = p * NR + j, k = 2 * q + i;
                    out[((p * kq + q) * NR + j) * 2 + i] = (n < N && k < K) ? W[n * K + k] : 0;
                }
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <omp.h>

int lmi_gemm_bf16w_available(void) { return 1; }

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

/* kernels/cpu_panel.h's loop over a table of row-block kernels (rows of A of type ATYPE). */
typedef struct {
    const void *A, *bias;
    const uint16_t *Bp;
    void *C;
    int64_t lda, K, N, ldc;
    int out_bf16;
} bf_ctx;

#define BF_BLOCK(NAME, TABLE, ATYPE)                                                                \
    static void NAME(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) { \
        const bf_ctx *c = (const bf_ctx *)v;                                                        \
        const int64_t kq = (c->K + 1) / 2;                                                          \
        const uint16_t *B = c->Bp + p * kq * NR * 2;                                                \
        const float *bias = (const float *)c->bias;                                                 \
        TABLE[rows]((const ATYPE *)c->A + row * c->lda, c->lda, B, c->K,                            \
                    (char *)c->C + (row * c->ldc + p * NR) * (c->out_bf16 ? 2 : 4), c->ldc, c->out_bf16, \
                    bias ? bias + p * NR : 0, c->N - p * NR < NR ? c->N - p * NR : NR,              \
                    next ? B + kq * NR * 2 : 0, i, nb);                                             \
    }
#define DRIVE(BLOCK, ATYPE, MRMAX)                                                                  \
    const bf_ctx c = {A, bias, Bp, C, lda, K, N, ldc, out_bf16};                                    \
    lmi_panel_drive(M, (N + NR - 1) / NR, lmi_panel_chunk(K * (int64_t)sizeof(ATYPE), MRMAX), MRMAX, nthreads, \
                    BLOCK, 0, &c);
BF_BLOCK(kfw_block, KFW, float)

/* A [M, K] fp32 at row stride lda (K contiguous), Bp from lmi_pack_bf16, bias [N] fp32 or NULL,
 * C [M, N] at row stride ldc: fp32, or bf16 when out_bf16. Products and sums in fp32 FMAs. */
void lmi_gemm_bf16w(const float *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                    const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads) {
    DRIVE(kfw_block, float, MRW)
}

#if defined(__AVX512BF16__)
int lmi_gemm_bf16_available(void) { return 1; }

/* A [M, K] fp32 at row stride lda -> out [M, K] bf16 at row stride ldo. */
void lmi_bf16_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint16_t *out, int64_t ldo,
                   int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t m = 0; m < M; ++m) {
        const float *a = A + m * lda;
        uint16_t *o = out + m * ldo;
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

/* A [M, K] bf16 at row stride lda (K contiguous), Bp from lmi_pack_bf16, bias [N] fp32 or NULL,
 * C [M, N] at row stride ldc: fp32, or bf16 when out_bf16. Products by vdpbf16ps. */
BF_BLOCK(kbf_block, KBF, uint16_t)

void lmi_gemm_bf16(const uint16_t *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                   const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads) {
    DRIVE(kbf_block, uint16_t, MRMAX)
}
#endif
#elif (defined(__AVX2__) && defined(__FMA__)) || (defined(__ARM_NEON) && defined(__aarch64__))
/* AVX2+FMA and aarch64 NEON: the widening kernels over cpu_simd.h's 8-lane vectors, the same
 * panels, partition, chunking and prefetching, and per output the same FMAs in the same k order
 * then + bias (then the same rounding to bf16): the AVX-512 build's values bit for bit. Blocks of
 * up to MRV rows x 32 columns: per pair, each 8-column quarter of the panel is loaded and widened
 * once (k = 2q: shifted left 16 bits; k = 2q+1: the high half) and feeds the block's rows, whose
 * two broadcasts per row stay in registers (AVX2: 8 accumulators + 4 broadcasts + 3 of 16 ymm).
 * The vdpbf16ps kernels (lmi_gemm_bf16) stay AVX512-BF16 only. */
#include <omp.h>

#include "cpu_simd.h"

#define MRV 2

int lmi_gemm_bf16w_available(void) { return 1; }

#define KERNELV(MR)                                                                                 \
    static void kv_##MR(const float *A, int64_t lda, const uint16_t *B, int64_t K, void *C,         \
                        int64_t ldc, int out_bf16, const float *bias, int64_t ncols,                \
                        const uint16_t *Bn, int64_t pf0, int64_t pfs) {                             \
        v8f c[MR][4];                                                                               \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            UNROLL_MR for (int v = 0; v < 4; ++v) c[r][v] = v8f_zero();                             \
        }                                                                                           \
        const int64_t kq = (K + 1) / 2, kfull = K / 2;                                              \
        int64_t pfq = Bn ? pf0 : kq;                                                                \
        for (int64_t q = 0; q < kfull; ++q) {                                                       \
            if (q == pfq) {                                                                         \
                LMI_PREFETCH_L2(Bn + q * NR * 2);                                                   \
                LMI_PREFETCH_L2(Bn + q * NR * 2 + 32);                                              \
                pfq += pfs;                                                                         \
            }                                                                                       \
            const uint16_t *w = B + q * NR * 2;                                                     \
            LMI_PREFETCH_L1(w + 8 * NR * 2);                                                        \
            LMI_PREFETCH_L1(w + 8 * NR * 2 + 32);                                                   \
            v8f ae[MR], ao[MR];                                                                     \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                ae[r] = v8f_set1(A[r * lda + 2 * q]);                                               \
                ao[r] = v8f_set1(A[r * lda + 2 * q + 1]);                                           \
            }                                                                                       \
            UNROLL_MR for (int v = 0; v < 4; ++v) {                                                 \
                LMI_V8_SEQ();                                                                       \
                const v8f e = v8f_bf16_lo(w + 16 * v), o = v8f_bf16_hi(w + 16 * v);                \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_fma(ae[r], e, c[r][v]);        \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_fma(ao[r], o, c[r][v]);        \
            }                                                                                       \
        }                                                                                           \
        if (kfull < kq) { /* odd K: the last value alone */                                         \
            const uint16_t *w = B + kfull * NR * 2;                                                 \
            UNROLL_MR for (int v = 0; v < 4; ++v) {                                                 \
                const v8f e = v8f_bf16_lo(w + 16 * v);                                              \
                UNROLL_MR for (int r = 0; r < MR; ++r)                                              \
                    c[r][v] = v8f_fma(v8f_set1(A[r * lda + K - 1]), e, c[r][v]);                    \
            }                                                                                       \
        }                                                                                           \
        UNROLL_MR for (int v = 0; v < 4; ++v) {                                                     \
            const int n = (int)(ncols - 8 * v);                                                     \
            if (n <= 0) break;                                                                      \
            if (bias) {                                                                             \
                const v8f bb = v8f_load_n(bias + 8 * v, n);                                         \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_add(c[r][v], bb);              \
            }                                                                                       \
            if (out_bf16) {                                                                         \
                UNROLL_MR for (int r = 0; r < MR; ++r)                                              \
                    v8f_store_bf16_n((uint16_t *)C + r * ldc + 8 * v, c[r][v], n);                  \
            } else {                                                                                \
                UNROLL_MR for (int r = 0; r < MR; ++r) v8f_store_n((float *)C + r * ldc + 8 * v, c[r][v], n); \
            }                                                                                       \
        }                                                                                           \
    }
KERNELV(1) KERNELV(2)

typedef void (*kv_t)(const float *, int64_t, const uint16_t *, int64_t, void *, int64_t, int,
                     const float *, int64_t, const uint16_t *, int64_t, int64_t);
static const kv_t KV[MRV + 1] = {0, kv_1, kv_2};

/* The same loop (kernels/cpu_panel.h) over this build's row blocks of up to MRV rows. */
typedef struct {
    const float *A, *bias;
    const uint16_t *Bp;
    void *C;
    int64_t lda, K, N, ldc;
    int out_bf16;
} bfv_ctx;

static void kv_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const bfv_ctx *c = (const bfv_ctx *)v;
    const int64_t kq = (c->K + 1) / 2;
    const uint16_t *B = c->Bp + p * kq * NR * 2;
    KV[rows](c->A + row * c->lda, c->lda, B, c->K, (char *)c->C + (row * c->ldc + p * NR) * (c->out_bf16 ? 2 : 4),
             c->ldc, c->out_bf16, c->bias ? c->bias + p * NR : 0, c->N - p * NR < NR ? c->N - p * NR : NR,
             next ? B + kq * NR * 2 : 0, i, nb);
}

void lmi_gemm_bf16w(const float *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                    const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads) {
    const bfv_ctx c = {A, bias, Bp, C, lda, K, N, ldc, out_bf16};
    lmi_panel_drive(M, (N + NR - 1) / NR, lmi_panel_chunk(K * 4, MRV), MRV, nthreads, kv_block, 0, &c);
}
#else
int lmi_gemm_bf16w_available(void) { return 0; }

void lmi_gemm_bf16w(const float *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                    const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads) {
    (void)A; (void)M; (void)K; (void)lda; (void)Bp; (void)N; (void)bias; (void)C; (void)ldc; (void)out_bf16;
    (void)nthreads;
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__))
int lmi_gemm_bf16_available(void) { return 0; }

void lmi_bf16_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint16_t *out, int64_t ldo,
                   int nthreads) {
    (void)A; (void)M; (void)K; (void)lda; (void)out; (void)ldo; (void)nthreads;
}

void lmi_gemm_bf16(const uint16_t *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                   const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads) {
    (void)A; (void)M; (void)K; (void)lda; (void)Bp; (void)N; (void)bias; (void)C; (void)ldc; (void)out_bf16;
    (void)nthreads;
}
#endif
