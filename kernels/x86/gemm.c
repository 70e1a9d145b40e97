/* The fp32 panel GEMM's row blocks on x86 (kernels/cpu_arch.h's lmi_arch_gemm_*; kernels/cpu_gemm.c
 * packs the panels and drives the blocks). AVX-512F: up to 14 rows x 32 columns of accumulators in
 * 28 zmm registers; for each k, two loads of the panel, one broadcast per row, two FMAs per row (14
 * rows against 12: 218 against 200 GFLOP/s at 1,024 rows on the dev host, 93% of its FMA peak; each
 * panel load feeds more FMAs). AVX2+FMA (the avx2 build): kernels/cpu_v8.h's 8-lane blocks of up to
 * 3 rows, per output the same operations in the same order, so the same values bit for bit. */
#include <stdint.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32

#if defined(__AVX512F__)
#include <immintrin.h>

#define MRMAX 14

/* MR rows of A (row stride lda) x one panel B [K][32] -> C (row stride ldc), ncols <= 32 of them
 * stored. Bn (or NULL): the next panel; this row block prefetches its k-rows pf0, pf0 + pfs, ...
 * into L2, so the panel's row blocks share the prefetching. */
/* The L1 prefetch distance in k-rows of the panel: one row streams its panel from memory at the
 * loop's pace (no next-panel prefetch, see gemm_block), so it looks 4 KiB ahead; 1-row decode
 * GEMMs of the 0.5 B Qwen's shapes on 2 Zen 4 cores: 5-10% less time (3 of 4 interleaved runs) than 8 ahead with the
 * next-panel L2 prefetch (benchmarks/archive/gemv_stream.py). Bigger blocks read the panel from L2. */
#define PFD(MR) ((MR) == 1 ? 32 : 8)
#define KERNEL(MR, NAME, PF)   /* PF 0: a panel already in the caches, nothing prefetched */         \
    static void NAME##_##MR(const float *A, int64_t lda, const float *B, int64_t K, float *C,         \
                          int64_t ldc, const float *bias, int64_t ncols, const float *Bn,           \
                          int64_t pf0, int64_t pfs) {                                               \
        __m512 c0[MR], c1[MR];                                                                      \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            c0[r] = _mm512_setzero_ps();                                                            \
            c1[r] = _mm512_setzero_ps();                                                            \
        }                                                                                           \
        int64_t pfk = Bn ? pf0 : K;                                                                 \
        for (int64_t k = 0; k < K; ++k) {                                                           \
            if (PF && k == pfk) {                                                                   \
                _mm_prefetch((const char *)(Bn + k * NR), _MM_HINT_T1);                             \
                _mm_prefetch((const char *)(Bn + k * NR + 16), _MM_HINT_T1);                        \
                pfk += pfs;                                                                         \
            }                                                                                       \
            const __m512 b0 = _mm512_loadu_ps(B + k * NR), b1 = _mm512_loadu_ps(B + k * NR + 16);   \
            if (PF) {                                                                               \
                _mm_prefetch((const char *)(B + (k + PFD(MR)) * NR), _MM_HINT_T0);                  \
                _mm_prefetch((const char *)(B + (k + PFD(MR)) * NR + 16), _MM_HINT_T0);             \
            }                                                                                       \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                const __m512 a = _mm512_set1_ps(A[r * lda + k]);                                    \
                c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);                                              \
                c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);                                              \
            }                                                                                       \
        }                                                                                           \
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
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            _mm512_mask_storeu_ps(C + r * ldc, m0, c0[r]);                                          \
            _mm512_mask_storeu_ps(C + r * ldc + 16, m1, c1[r]);                                     \
        }                                                                                           \
    }
#define KERNELS(NAME, PF) KERNEL(1, NAME, PF) KERNEL(2, NAME, PF) KERNEL(3, NAME, PF) KERNEL(4, NAME, PF)      \
    KERNEL(5, NAME, PF) KERNEL(6, NAME, PF) KERNEL(7, NAME, PF) KERNEL(8, NAME, PF) KERNEL(9, NAME, PF)         \
    KERNEL(10, NAME, PF) KERNEL(11, NAME, PF) KERNEL(12, NAME, PF) KERNEL(13, NAME, PF) KERNEL(14, NAME, PF)
KERNELS(kern, 1) KERNELS(kc, 0)

typedef void (*kern_t)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *,
                       int64_t, const float *, int64_t, int64_t);
#define TABLE(NAME) {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8, \
                     NAME##_9, NAME##_10, NAME##_11, NAME##_12, NAME##_13, NAME##_14}
static const kern_t KERNS[MRMAX + 1] = TABLE(kern), KERNC[MRMAX + 1] = TABLE(kc);

#define MRB MRMAX
#define PF_NEXT_ROWS 2      /* a 1-row block leaves the next panel to its far L1 prefetch (PFD) */
#elif defined(__AVX2__) && defined(__FMA__)
#define LMI_V8_GEMM
/* As on AVX-512: a 1-row block looks 4 KiB ahead and leaves the next panel alone. On a Zen 3 host (2 vCPUs,
 * AVX2) 1-row GEMMs of the 0.5 B Qwen's layer shapes read their weights in 0.75x the time (interleaved
 * processes: 87-112 ms against 117-149 with the next-panel L2 prefetch); 2 rows and more unchanged. */
#define V8_GEMM_PFD1 32
#include "../cpu_v8.h"

#define KERNS V8_GEMM
#define KERNC V8_GEMM_CACHED
#define MRB V8_GEMM_ROWS
#define PF_NEXT_ROWS 2
#else
#error "kernels/x86/ needs AVX2 and FMA at least (kernels/isa.py's avx2 or avx512 build)"
#endif

int lmi_arch_gemm_rows(void) { return MRB; }

void lmi_arch_gemm_block(const float *A, int64_t lda, const float *B, int64_t K, float *C, int64_t ldc,
                         const float *bias, int64_t ncols, const float *Bn, int64_t pf0, int64_t pfs, int64_t rows) {
    KERNS[rows](A, lda, B, K, C, ldc, bias, ncols, rows >= PF_NEXT_ROWS ? Bn : 0, pf0, pfs);
}

void lmi_arch_gemm_block_cached(const float *A, int64_t lda, const float *B, int64_t K, float *C, int64_t ldc,
                                const float *bias, int64_t ncols, int64_t rows) {
    KERNC[rows](A, lda, B, K, C, ldc, bias, ncols, 0, 0, 1);
}
