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
 * each (kernels/cpu_gemm.c's over the widened weight). The row blocks are the architecture layer's
 * (kernels/cpu_arch.h's lmi_arch_bf16*: kernels/x86/gemm_bf16.c, kernels/arm/gemm_bf16.c); this file
 * packs and drives them on kernels/cpu_panel.h.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_api.h"
#include "cpu_arch.h"
#include "cpu_panel.h"

#define NR 32

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

int lmi_gemm_bf16w_available(void) { return lmi_arch_bf16w_rows() > 0; }
int lmi_gemm_bf16_available(void) { return lmi_arch_bf16_rows() > 0; }

/* kernels/cpu_panel.h's loop over the arch layer's row blocks (rows of A of type ATYPE). */
typedef struct {
    lmi_panel_pad A;                /* first: lmi_panel_pad_prep's */
    const void *bias;
    const uint16_t *Bp;
    void *C;
    int64_t K, N, ldc;
    int out_bf16;
} bf_ctx;

#define BF_BLOCK(NAME, KERNEL, ATYPE)                                                               \
    static void NAME(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) { \
        const bf_ctx *c = (const bf_ctx *)v;                                                        \
        const int64_t kq = (c->K + 1) / 2;                                                          \
        const uint16_t *B = c->Bp + p * kq * NR * 2;                                                \
        const float *bias = (const float *)c->bias;                                                 \
        KERNEL((const ATYPE *)lmi_panel_pad_row(&c->A, row), c->A.ldp_bytes / sizeof(ATYPE), B, c->K, \
               (char *)c->C + (row * c->ldc + p * NR) * (c->out_bf16 ? 2 : 4), c->ldc, c->out_bf16, \
               bias ? bias + p * NR : 0, c->N - p * NR < NR ? c->N - p * NR : NR,                   \
               next ? B + kq * NR * 2 : 0, i, nb, rows);                                            \
    }
BF_BLOCK(bfw_block, lmi_arch_bf16w_block, float)
BF_BLOCK(bf_block, lmi_arch_bf16_block, uint16_t)

/* A [M, K] fp32 at row stride lda (K contiguous), Bp from lmi_pack_bf16, bias [N] fp32 or NULL,
 * C [M, N] at row stride ldc: fp32, or bf16 when out_bf16. Products and sums in fp32 FMAs. */
void lmi_gemm_bf16w(const float *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                    const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads) {
    bf_ctx c = {{0}, bias, Bp, C, K, N, ldc, out_bf16};
    const int64_t mr = lmi_arch_bf16w_rows();
    lmi_panel_drive_rows(&c.A, A, M, K * 4, lda * 4, (N + NR - 1) / NR, mr, nthreads, bfw_block, &c);
}

/* A [M, K] fp32 at row stride lda -> out [M, K] bf16 at row stride ldo (builds with vdpbf16ps only). */
void lmi_bf16_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint16_t *out, int64_t ldo,
                   int nthreads) {
    if (!lmi_arch_bf16_rows()) return;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t m = 0; m < M; ++m) lmi_arch_bf16_round_row(A + m * lda, K, out + m * ldo);
}

/* A [M, K] bf16 at row stride lda (K contiguous), Bp from lmi_pack_bf16, bias [N] fp32 or NULL,
 * C [M, N] at row stride ldc: fp32, or bf16 when out_bf16. Products by vdpbf16ps (builds without
 * them: nothing; lmi_gemm_bf16_available() says which). */
void lmi_gemm_bf16(const uint16_t *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                   const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads) {
    const int64_t mr = lmi_arch_bf16_rows();
    if (!mr) return;
    bf_ctx c = {{0}, bias, Bp, C, K, N, ldc, out_bf16};
    lmi_panel_drive_rows(&c.A, A, M, K * 2, lda * 2, (N + NR - 1) / NR, mr, nthreads, bf_block, &c);
}
