/* Small-batch fp32 GEMM for CPU linear layers: C[M, N] = A[M, K] @ W^T (+ bias), with W [N, K]
 * (nn.Linear's weight) packed once into panels of 32 output columns, [ceil(N/32)][K][32], zero
 * padded (lmi_pack_b). kernels/cpu/ builds and loads it; handler/model/cpu.py's PanelLinear uses it.
 *
 * Why: a decode step multiplies 1-64 rows by every weight, so the weights stream from memory
 * once per step. oneDNN's kernels at these sizes spent the memory time and the compute time one
 * after the other (135 M Llama's layer GEMMs on 2 cores: 20 ms of streaming plus 0.67 ms per row).
 * Here each thread owns a contiguous range of panels and, while it multiplies the current panel
 * (from L2 after the first row block), prefetches the next panel into L2: the stream hides under
 * the multiplications.
 *
 * Microkernel: up to 14 rows x 32 columns of accumulators in 28 zmm registers; for each k, two
 * loads of the panel, one broadcast per row, two FMAs per row (14 rows against 12: 218 against
 * 200 GFLOP/s at 1,024 rows on the dev host, 93% of its FMA peak; each panel load feeds more FMAs). Each output element is
 * sum_k A[m, k] * W[n, k] accumulated in k order by fused multiply-adds from 0, then + bias:
 * a row's result depends only on that row (the same in any batch). Rows go in chunks whose A
 * slice stays in L2 (about 1 MiB), the row blocks of a chunk near-equal in size.
 *
 * Builds (kernels/isa.py): AVX-512F (the kernel above), AVX2+FMA and aarch64 NEON (the same
 * panels and per-output operations over 8-lane vectors: the same values bit for bit, in blocks of
 * up to 3 rows); elsewhere lmi_gemm_available() returns 0 and the caller keeps oneDNN.
 */
#include <stdint.h>

#include "cpu_api.h"

#define NR 32
#define MRMAX 14

/* W [N, K] row-major -> panels [ceil(N/32)][K][32], zero padded. */
void lmi_pack_b(const float *W, int64_t N, int64_t K, float *out) {
    int64_t np = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < NR; ++j) {
                int64_t n = p * NR + j;
                out[(p * K + k) * NR + j] = n < N ? W[n * K + k] : 0.f;
            }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

int lmi_gemm_available(void) { return 1; }

/* MR rows of A (row stride lda) x one panel B [K][32] -> C (row stride ldc), ncols <= 32 of them
 * stored. Bn (or NULL): the next panel; this row block prefetches its k-rows pf0, pf0 + pfs, ...
 * into L2, so the panel's row blocks share the prefetching. */
/* The L1 prefetch distance in k-rows of the panel: one row streams its panel from memory at the
 * loop's pace (no next-panel prefetch, see gemm_block), so it looks 4 KiB ahead; 1-row decode
 * GEMMs of the 0.5 B Qwen's shapes on 2 Zen 4 cores: 5-10% less time (3 of 4 interleaved runs) than 8 ahead with the
 * next-panel L2 prefetch (benchmarks/gemv_stream.py). Bigger blocks read the panel from L2. */
#define PFD(MR) ((MR) == 1 ? 32 : 8)
#define KERNEL(MR)                                                                                  \
    static void kern_##MR(const float *A, int64_t lda, const float *B, int64_t K, float *C,         \
                          int64_t ldc, const float *bias, int64_t ncols, const float *Bn,           \
                          int64_t pf0, int64_t pfs) {                                               \
        __m512 c0[MR], c1[MR];                                                                      \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            c0[r] = _mm512_setzero_ps();                                                            \
            c1[r] = _mm512_setzero_ps();                                                            \
        }                                                                                           \
        int64_t pfk = Bn ? pf0 : K;                                                                 \
        for (int64_t k = 0; k < K; ++k) {                                                           \
            if (k == pfk) {                                                                         \
                _mm_prefetch((const char *)(Bn + k * NR), _MM_HINT_T1);                             \
                _mm_prefetch((const char *)(Bn + k * NR + 16), _MM_HINT_T1);                        \
                pfk += pfs;                                                                         \
            }                                                                                       \
            const __m512 b0 = _mm512_loadu_ps(B + k * NR), b1 = _mm512_loadu_ps(B + k * NR + 16);   \
            _mm_prefetch((const char *)(B + (k + PFD(MR)) * NR), _MM_HINT_T0);                      \
            _mm_prefetch((const char *)(B + (k + PFD(MR)) * NR + 16), _MM_HINT_T0);                 \
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
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)
KERNEL(7) KERNEL(8) KERNEL(9) KERNEL(10) KERNEL(11) KERNEL(12) KERNEL(13) KERNEL(14)

typedef void (*kern_t)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *,
                       int64_t, const float *, int64_t, int64_t);
static const kern_t KERNS[MRMAX + 1] = {0, kern_1, kern_2, kern_3, kern_4, kern_5, kern_6,
                                        kern_7, kern_8, kern_9, kern_10, kern_11, kern_12, kern_13, kern_14};

#define MRB MRMAX
#define KERNB KERNS
#define PF_NEXT_ROWS 2      /* a 1-row block leaves the next panel to its far L1 prefetch (PFD) */
#define LMI_GEMM_DRIVER
#elif (defined(__AVX2__) && defined(__FMA__)) || (defined(__ARM_NEON) && defined(__aarch64__))
/* AVX2+FMA and aarch64 NEON: one source over cpu_simd.h's 8-lane vectors (a panel row is 4 of them).
 * The same panels, partition, chunking and prefetching as above, and per output the same
 * operations in the same order (FMAs in k order from 0, then + bias): the AVX-512 build's values
 * bit for bit. Register blocks of up to MRV rows x 32 columns: AVX2's 16 ymm hold 3 rows' 12
 * accumulators and the row broadcasts (the panel loads fold into the FMAs); NEON's 32 q registers
 * 3 rows' 24 (4-lane halves) beside the broadcasts and a panel load. */
#include <omp.h>

#include "cpu_simd.h"

#define MRV 3

int lmi_gemm_available(void) { return 1; }

/* MR rows of A (row stride lda) x one panel B [K][32] -> C (row stride ldc), ncols <= 32 of them
 * stored; Bn / pf0 / pfs: the next panel's L2 prefetch, shared by the panel's row blocks (as above). */
#define KERNELV(MR)                                                                                 \
    static void kv_##MR(const float *A, int64_t lda, const float *B, int64_t K, float *C,           \
                        int64_t ldc, const float *bias, int64_t ncols, const float *Bn,             \
                        int64_t pf0, int64_t pfs) {                                                 \
        v8f c[MR][4];                                                                               \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            UNROLL_MR for (int v = 0; v < 4; ++v) c[r][v] = v8f_zero();                             \
        }                                                                                           \
        int64_t pfk = Bn ? pf0 : K;                                                                 \
        for (int64_t k = 0; k < K; ++k) {                                                           \
            if (k == pfk) {                                                                         \
                LMI_PREFETCH_L2(Bn + k * NR);                                                       \
                LMI_PREFETCH_L2(Bn + k * NR + 16);                                                  \
                pfk += pfs;                                                                         \
            }                                                                                       \
            const float *b = B + k * NR;                                                            \
            LMI_PREFETCH_L1(b + 8 * NR);                                                            \
            LMI_PREFETCH_L1(b + 8 * NR + 16);                                                       \
            v8f a[MR];                                                                              \
            UNROLL_MR for (int r = 0; r < MR; ++r) a[r] = v8f_set1(A[r * lda + k]);                 \
            UNROLL_MR for (int v = 0; v < 4; ++v) {                                                 \
                LMI_V8_SEQ();                                                                       \
                const v8f bv = v8f_load(b + 8 * v);                                                 \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_fma(a[r], bv, c[r][v]);        \
            }                                                                                       \
        }                                                                                           \
        UNROLL_MR for (int v = 0; v < 4; ++v) {                                                     \
            const int n = (int)(ncols - 8 * v);                                                     \
            if (n <= 0) break;                                                                      \
            if (bias) {                                                                             \
                const v8f bb = v8f_load_n(bias + 8 * v, n);                                         \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_add(c[r][v], bb);              \
            }                                                                                       \
            UNROLL_MR for (int r = 0; r < MR; ++r) v8f_store_n(C + r * ldc + 8 * v, c[r][v], n);    \
        }                                                                                           \
    }
KERNELV(1) KERNELV(2) KERNELV(3)

typedef void (*kern_t)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *,
                       int64_t, const float *, int64_t, int64_t);
static const kern_t KERNS[MRV + 1] = {0, kv_1, kv_2, kv_3};

#define MRB MRV
#define KERNB KERNS
#define PF_NEXT_ROWS 1
#define LMI_GEMM_DRIVER
#else
int lmi_gemm_available(void) { return 0; }

void lmi_gemm(const float *A, int64_t M, int64_t K, int64_t lda, const float *Bp, int64_t N,
              const float *bias, float *C, int64_t ldc, int nthreads) {
    (void)A; (void)M; (void)K; (void)lda; (void)Bp; (void)N; (void)bias; (void)C; (void)ldc; (void)nthreads;
}
#endif

#ifdef LMI_GEMM_DRIVER
#include "cpu_arch.h"
#include "cpu_panel.h"

int lmi_arch_gemm_rows(void) { return MRB; }

void lmi_arch_gemm_block(const float *A, int64_t lda, const float *B, int64_t K, float *C, int64_t ldc,
                         const float *bias, int64_t ncols, const float *Bn, int64_t pf0, int64_t pfs, int64_t rows) {
    KERNB[rows](A, lda, B, K, C, ldc, bias, ncols, rows >= PF_NEXT_ROWS ? Bn : 0, pf0, pfs);
}

typedef struct {
    const float *A, *Bp, *bias;
    float *C;
    int64_t lda, K, N, ldc;
} gemm_ctx;

static void gemm_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const gemm_ctx *c = (const gemm_ctx *)v;
    const float *B = c->Bp + p * c->K * NR;
    lmi_arch_gemm_block(c->A + row * c->lda, c->lda, B, c->K, c->C + row * c->ldc + p * NR, c->ldc,
                        c->bias ? c->bias + p * NR : 0, c->N - p * NR < NR ? c->N - p * NR : NR,
                        next ? B + c->K * NR : 0, i, nb, rows);
}

/* A [M, K] at row stride lda (K contiguous), Bp from lmi_pack_b, bias [N] or NULL,
 * C [M, N] at row stride ldc (kernels/cpu_panel.h's loop over this build's row blocks). */
void lmi_gemm(const float *A, int64_t M, int64_t K, int64_t lda, const float *Bp, int64_t N,
              const float *bias, float *C, int64_t ldc, int nthreads) {
    const gemm_ctx c = {A, Bp, bias, C, lda, K, N, ldc};
    lmi_panel_drive(M, (N + NR - 1) / NR, lmi_panel_chunk(K * 4, MRB), MRB, nthreads, gemm_block, 0, &c);
}
#endif

/* The read-stream probe `bench floor` measures the memory floor with (handler/tools/bench/floor.py):
 * n floats summed over nthreads threads, each a contiguous share, in 16 independent lanes (so the
 * compiler vectorises it without reassociating: wide loads, nothing written). Returns the sum, so
 * the loads cannot be dropped. */
#include <omp.h>
float lmi_stream_read(const float *x, int64_t n, int nthreads) {
    float total = 0.f;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(+ : total)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = n * t / nt / 16 * 16, hi = t + 1 == nt ? n : n * (t + 1) / nt / 16 * 16;
        float acc[16] = {0};
        int64_t i = lo;
        for (; i + 16 <= hi; i += 16)
            for (int j = 0; j < 16; ++j) acc[j] += x[i + j];
        for (; i < hi; ++i) acc[0] += x[i];
        for (int j = 0; j < 16; ++j) total += acc[j];
    }
    return total;
}
