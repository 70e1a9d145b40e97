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
 * Row blocks: the architecture layer's (kernels/cpu_arch.h's lmi_arch_gemm_block: kernels/x86/gemm.c,
 * up to 14 rows x 32 columns in 28 zmm registers on AVX-512, 3 rows on AVX2; kernels/arm/gemm.c, 3
 * rows on NEON). Each output element is sum_k A[m, k] * W[n, k] accumulated in k order by fused
 * multiply-adds from 0, then + bias: a row's result depends only on that row (the same in any batch),
 * and every build gives the same values bit for bit. Rows go in chunks whose A slice stays in L2
 * (about 1 MiB), the row blocks of a chunk near-equal in size (kernels/cpu_panel.h); rows 4 KiB apart
 * (or a multiple) are read from a copy at another stride (lmi_panel_pad: the same values).
 */
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "cpu_api.h"
#include "cpu_arch.h"
#include "cpu_panel.h"

#define NR 32

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

int lmi_gemm_available(void) { return lmi_arch_gemm_rows() > 0; }

typedef struct {
    lmi_panel_pad A;                /* first: lmi_panel_pad_prep's */
    const float *Bp, *bias;
    float *C;
    int64_t K, N, ldc;
} gemm_ctx;

static void gemm_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const gemm_ctx *c = (const gemm_ctx *)v;
    const float *B = c->Bp + p * c->K * NR;
    lmi_arch_gemm_block((const float *)lmi_panel_pad_row(&c->A, row), c->A.ldp_bytes / 4, B, c->K,
                        c->C + row * c->ldc + p * NR, c->ldc,
                        c->bias ? c->bias + p * NR : 0, c->N - p * NR < NR ? c->N - p * NR : NR,
                        next ? B + c->K * NR : 0, i, nb, rows);
}

/* A [M, K] at row stride lda (K contiguous), Bp from lmi_pack_b, bias [N] or NULL,
 * C [M, N] at row stride ldc (kernels/cpu_panel.h's loop over this build's row blocks). */
void lmi_gemm(const float *A, int64_t M, int64_t K, int64_t lda, const float *Bp, int64_t N,
              const float *bias, float *C, int64_t ldc, int nthreads) {
    gemm_ctx c = {{0}, Bp, bias, C, K, N, ldc};
    const int64_t mr = lmi_arch_gemm_rows();
    lmi_panel_drive_rows(&c.A, A, M, K * 4, lda * 4, (N + NR - 1) / NR, mr, nthreads, gemm_block, &c);
}

/* The read-stream probe `bench floor` measures the memory floor with (handler/tools/bench/floor.py):
 * n floats summed over nthreads threads, each a contiguous share, in 4 x 16 independent lanes (so the
 * compiler vectorises it without reassociating: wide loads, nothing written), each 64-float block
 * prefetched `ahead` floats early (0: the hardware prefetchers alone; the 1-row GEMMs look 4 KiB
 * ahead, past where those stop, and a probe without it read slower than served steps did). Returns
 * the sum, so the loads cannot be dropped. */
float lmi_stream_read(const float *x, int64_t n, int64_t ahead, int nthreads) {
    float total = 0.f;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(+ : total)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = n * t / nt / 64 * 64, hi = t + 1 == nt ? n : n * (t + 1) / nt / 64 * 64;
        float acc[4][16] = {{0}};
        int64_t i = lo;
        for (; i + 64 <= hi; i += 64) {
            if (ahead > 0 && i + ahead + 64 <= hi)
                for (int l = 0; l < 4; ++l) __builtin_prefetch(x + i + ahead + 16 * l, 0, 0);
            for (int l = 0; l < 4; ++l)
                for (int j = 0; j < 16; ++j) acc[l][j] += x[i + 16 * l + j];
        }
        for (; i < hi; ++i) acc[0][0] += x[i];
        for (int l = 0; l < 4; ++l)
            for (int j = 0; j < 16; ++j) total += acc[l][j];
    }
    return total;
}
