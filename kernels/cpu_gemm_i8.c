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
 * (and lmi_quant_rows the same bytes). The kernels are the architecture layer's (kernels/cpu_arch.h's
 * lmi_arch_i8_*: kernels/x86/gemm_i8.c, kernels/arm/gemm_i8.c); this file packs, quantizes the rows'
 * tails and drives them on kernels/cpu_panel.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_api.h"
#include "cpu_arch.h"
#include "cpu_panel.h"

#define NR 32

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
        const int64_t k16 = K / 16 * 16;    /* 16 lanes at a time by the arch layer, the rest here */
        float amax = lmi_arch_i8_absmax(a, k16);
        int64_t k = k16;
        for (; k < K; ++k) {
            const float v = fabsf(a[k]);
            amax = v > amax ? v : amax;
        }
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        scales[m] = s;
        lmi_arch_i8_quant(a, k16, inv, o);
        for (k = k16; k < K; ++k) {
            float q = nearbyintf(a[k] * inv);
            q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
            o[k] = (uint8_t)((int)q + 128);
        }
        for (k = K; k < Kp; ++k) o[k] = 128;
    }
}

int lmi_gemm_i8_available(void) { return lmi_arch_i8_rows() > 0; }

static void i8_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    lmi_arch_i8_block((const lmi_i8_args *)v, row, rows, p, next, i, nb);
}

/* Widened builds (lmi_arch_i8_widened): thread t of nt widens its share of a chunk's rows into A16
 * (one row: its kernel reads Aq). */
static void i8w_prep(const void *v, int64_t row, int64_t rows, int t, int nt) {
    const lmi_i8_args *c = (const lmi_i8_args *)v;
    if (rows < 2) return;
    const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
    lmi_arch_i8_widen(c->Aq + (row + r0) * c->Kp, r1 - r0, c->Kp, c->A16 + r0 * c->lda16, c->lda16);
}

/* Aq [M, Kp] uint8 from lmi_quant_rows with its scales sa [M]; Bp, wsum from lmi_pack_i8; sw [N]
 * the weight scales; bias [N] or NULL; C [M, N] fp32 at row stride ldc (kernels/cpu_panel.h's
 * loop over the arch layer's row blocks). Rows of Kp bytes a multiple of 4 KiB apart (K = 4096,
 * 8192, ...) are read from lmi_panel_pad's copy, as the fp32 panels' are. Widened builds (AVX2
 * without VNNI): the activations widened chunk by chunk into one buffer the threads share (the loop's
 * prep), blocks of 2-3 rows; its int16 rows are a cache line further apart where 2 Kp bytes would alias. */
void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp,
                 const int32_t *wsum, const float *sw, int64_t N, const float *bias, float *C, int64_t ldc,
                 int nthreads) {
    const int64_t np = (N + NR - 1) / NR;
    if (!lmi_arch_i8_widened()) {
        lmi_i8_args c = {{0}, Aq, 0, sa, sw, bias, Bp, wsum, C, Kp, Kp / 4, N, ldc, 0, 0};
        lmi_panel_drive_rows(&c.A, Aq, M, Kp, Kp, np, lmi_arch_i8_rows(), nthreads, i8_block, &c);
        return;
    }
    const int64_t MRW = lmi_arch_i8_rows();
    const int64_t lda16 = M >= LMI_PANEL_PAD_ROWS && (2 * Kp) % 4096 == 0 ? Kp + 32 : Kp;
    int64_t chunk = lmi_panel_chunk(2 * lda16, MRW);
    if (chunk > M) chunk = M;
    int16_t *A16 = 0;
    if (M > 1) {
        while (!(A16 = (int16_t *)malloc((size_t)(chunk * lda16) * sizeof(int16_t))) && chunk > 2)
            chunk = (chunk + 1) / 2;
        if (!A16) {     /* not even two rows' 4 Kp bytes: the same sums, one row at a time */
            for (int64_t m = 0; m < M; ++m)
                lmi_gemm_i8(Aq + m * Kp, 1, Kp, sa + m, Bp, wsum, sw, N, bias, C + m * ldc, ldc, nthreads);
            return;
        }
    }
    lmi_i8_args c = {{0}, Aq, A16, sa, sw, bias, Bp, wsum, C, Kp, Kp / 4, N, ldc, chunk > 0 ? chunk : 1, lda16};
    lmi_panel_pad_init(&c.A, Aq, 0, Kp, Kp, MRW);     /* no copy: the one-row blocks read Aq in place */
    lmi_panel_drive(M, np, c.chunk, MRW, nthreads, i8_block, i8w_prep, &c);
    free(A16);
}
