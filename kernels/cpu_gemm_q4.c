/* Grouped low-bit weight GEMM for CPU linear layers (AWQ, GPTQ, GGUF's blocks, W8A16):
 * C[M, N] = A[M, K] @ W^T (+ bias), fp32 activations, with
 *
 *   W[n, k] = q[n, k] * S[n, k / g] + Mn[n, k / g]        q of 4, 5, 6 or 8 bits
 *
 * one scale and one offset ("min", = -zero * scale for AWQ/GPTQ) per output channel n and group
 * of g consecutive k (handler/model/quant_int4.py maps every format to this one).
 *
 * Layout (packed in handler/model/quant_int4.py): panels of 32 output columns as in
 * kernels/cpu_gemm.c, [ceil(N/32)][K][RB] bytes, RB bytes a row k:
 *   4-bit (RB 16): byte j holds column j in its low nibble and column j + 16 in its high nibble;
 *   5/6-bit (RB 20/24): those 16 bytes (the codes' low 4 bits), then one 32-bit plane per higher
 *     bit (bit 4, then bit 5), bit j of a plane (little endian) belonging to column j;
 *   8-bit (RB 32): byte j, column j.
 * Scales and mins (smode), G = ceil(K/g) groups, zero padded:
 *   QS_F32: S, Mn fp32 [ceil(N/32)][G][32];
 *   QS_F16: S, Mn fp16 [ceil(N/32)][G][32] (formats whose scale and min fp16 holds exactly: GGUF's
 *     32-blocks, whose d is fp16 and min -8d / -16d / -128d or an fp16 m);
 *   QS_I8: two levels, as GGUF's K-quants store them: S, Mn int8 [ceil(N/32)][G][32] sub-scales
 *     times D, E fp32 [ceil(N/32)][ceil(G/sg)][32], one per sg groups (a 256-input superblock):
 *     s = D * S, m = E * Mn (an fp16 d times a 6/8-bit integer: exact in fp32).
 * Every mode yields the same fp32 s and m for a group, so the same weights bit for bit; the compact
 * ones only stream fewer bytes (Q4_K: 4.75 bits a weight against 6 with fp32 scales and mins;
 * Q6_K: 6.75 against 12 with byte codes and fp32 scales).
 *
 * Row blocks (the architecture layer's, kernels/cpu_arch.h's lmi_arch_q_*: kernels/x86/gemm_q4.c,
 * kernels/arm/gemm_q4.c over kernels/cpu_v8.h): for each k, the row's codes widened, dequantized
 * by one FMA each with the group's scale/min (held in registers for the group), then one FMA per
 * row and column (AVX-512: up to 12 rows x 32 columns in 24 zmm registers). The dequantized weight
 * is fma(q, s, m), exact for every format served (q * s has at most 8 + 11 + 8 significant bits,
 * and q * s + m is the format's weight rounded once, as numpy's / torch's dequantization rounds it),
 * and each output is summed in k order by FMAs from 0, then + bias: the
 * same operations, in the same order, as kernels/cpu_gemm.c on the dequantized fp32 weights. So a
 * quantized model computes bit for bit what its dequantized fp32 model computes on this path.
 * A row's result depends only on that row.
 *
 * A decode step streams every weight once, so its time is the code and scale bytes; the
 * dequantization costs about 8-14 instructions per k per 32 columns, shared by the row block. Past
 * one row block (M > 12) each panel is instead dequantized once into a per-thread fp32 buffer
 * (K x 32, in L2) and every row block runs the fp32 GEMM's row block over it (lmi_arch_gemm_block_cached:
 * the same values, the same order), so compute-bound prefill steps pay one dequantization per panel.
 *
 * Builds (kernels/isa.py): avx512 as above; AVX2+FMA(+F16C) and aarch64 NEON over 8-lane vectors
 * (register kernel up to 2 rows, dequantized panels past that), the same values bit for bit. The
 * opt-in int8-activation products (act8, lmi_arch_q_a8_*; every code width, groups as a8_serves takes
 * them): avx512 with VNNI and VBMI, and avx2, the same values; elsewhere act8 is ignored
 * (lmi_gemm_q_act8_available() returns 0).
 */
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "cpu_api.h"
#include "cpu_arch.h"
#include "cpu_panel.h"

#define NR 32

static inline lmi_qsrc qsrc_panel(int mode, const void *S, const void *Mn, const float *D, const float *E, int64_t sg,
                                  int64_t G, int64_t p) {
    const int64_t es = mode == QS_F32 ? 4 : mode == QS_F16 ? 2 : 1;
    const int64_t GS = mode == QS_I8 ? (G + sg - 1) / sg : 0;
    lmi_qsrc c = {mode, (const uint8_t *)S + p * G * NR * es, (const uint8_t *)Mn + p * G * NR * es,
                  mode == QS_I8 ? D + p * GS * NR : 0, mode == QS_I8 ? E + p * GS * NR : 0, sg > 0 ? sg : 1};
    return c;
}

int lmi_gemm_q_available(void) { return lmi_arch_q_rows() > 0; }

/* lmi_gemm_q_act8_available: whether this build multiplies with int8 activations where lmi_gemm_q's
 * act8 asks for them (avx512 with VNNI and VBMI, or avx2); elsewhere act8 is ignored. */
int lmi_gemm_q_act8_available(void) { return lmi_arch_q_a8_rows() > 0; }

/* The context of a grouped GEMM's panel loop (kernels/cpu_panel.h): the operands as lmi_gemm_q takes
 * them; W: nt per-thread dequantized panels (K x 32 fp32 each) or NULL; aq, da, sa, si: the int8 rows. */
typedef struct {
    lmi_panel_pad pad;  /* first (lmi_panel_pad_prep's): exact path, A or its copy where its rows are 4 KiB apart */
    const float *A, *bias, *D, *E;
    const uint8_t *Bp;
    const void *S, *Mn;
    float *C, *W;
    int64_t lda, K, N, ldc, g, G, sg, pbytes;
    int smode, bits;
    const int8_t *aq;
    const float *da, *sa;
    const int32_t *si;
    uint8_t *T;         /* int8 path: nt per-thread transposed panels (K x 32 bytes each) or NULL */
} q_ctx;

/* Threads for np panels: at most one a panel, at least one (as kernels/cpu_panel.h's loop). */
static inline int team(int nthreads, int64_t np) {
    return nthreads > np ? (int)np : nthreads < 1 ? 1 : nthreads;
}

/* Rows [row, row + rows) (a whole chunk: one block) with int8 activations x panel p: with T, the panel
 * transposed once into this thread's T and blocks of lmi_arch_q_a8_transposed_rows(bits) rows over it;
 * else the register kernels, lmi_arch_q_a8_rows() rows a pass, the first prefetching the next panel. */
static void qa8_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    (void)i, (void)nb;
    const q_ctx *c = (const q_ctx *)v;
    const int64_t K = c->K, G = c->G;
    const lmi_qsrc s = qsrc_panel(c->smode, c->S, c->Mn, c->D, c->E, c->sg, G, p);
    const uint8_t *B = c->Bp + p * c->pbytes, *Bn = next ? B + c->pbytes : 0;
    const int64_t ncols = c->N - p * NR < NR ? c->N - p * NR : NR;
    const float *bias = c->bias ? c->bias + p * NR : 0;
    const int transposed = c->T != 0;
    const int64_t step = transposed ? lmi_arch_q_a8_transposed_rows(c->bits) : lmi_arch_q_a8_rows();
    if (transposed) {
        uint8_t *T = c->T + (int64_t)omp_get_thread_num() * K * 32;
        lmi_arch_q_a8_transpose(B, K, c->bits, T, Bn);
        B = T, Bn = 0;
    }
    for (int64_t r0 = row; r0 < row + rows; r0 += step) {
        const int64_t mr = row + rows - r0 < step ? row + rows - r0 : step;
        lmi_arch_q_a8_block(c->aq + r0 * K, c->da + r0 * G, c->sa + r0 * G, c->si + r0 * G, G, B, K, c->g, &s,
                            c->C + r0 * c->ldc + p * NR, c->ldc, bias, ncols, r0 == row ? Bn : 0, transposed,
                            c->bits, mr);
    }
}

/* Every row with int8 activations over all panels (the caller checked a8_serves): the rows quantized
 * once, then kernels/cpu_panel.h's loop over qa8_block (a row's result depends on that row only).
 * Returns 0, C untouched, where the quantized rows cannot be allocated (the caller then takes the
 * exact path). */
static int gemm_q_a8(q_ctx *c, int64_t M, int64_t np, int nthreads) {
    const int64_t K = c->K, G = c->G;
    int8_t *aq = (int8_t *)malloc((size_t)(M * K + 64));
    float *da = (float *)malloc((size_t)(M * G * 3) * sizeof(float));
    if (!aq || !da) {
        free(aq), free(da);
        return 0;
    }
    float *sa = da + M * G;
    int32_t *si = (int32_t *)(sa + M * G);
    for (int64_t r = 0; r < M; ++r)
        lmi_arch_q_a8_row(c->A + r * c->lda, K, c->g, aq + r * K, da + r * G, sa + r * G, si + r * G);
    c->aq = aq, c->da = da, c->sa = sa, c->si = si;
    const int64_t mr = lmi_arch_q_a8_rows();
    /* more than those rows, where the build transposes these codes (avx2: all; avx512: 5/6-bit): each
     * thread's panel transposed once into its T (K x 32 bytes, L2; K % 4 == 0) and paid once per panel, not
     * once per register block */
    if (lmi_arch_q_a8_transposed_rows(c->bits) && M > mr)
        c->T = (uint8_t *)aligned_alloc(64, (size_t)team(nthreads, np) * (size_t)K * 32);
    /* rows whose int8 activations stay in L2 (half of the fp32 paths' 1 MiB); each chunk one block, which
     * qa8_block walks in fixed steps from its first row (near-equal blocks measured slower on avx2: more
     * of the transposed kernel's 2-row calls) */
    const int64_t chunk = lmi_panel_chunk(2 * K, mr);
    lmi_panel_drive(M, np, chunk, chunk, nthreads, qa8_block, 0, c);
    free(c->T);
    free(aq), free(da);
    return 1;
}

/* Whether int8 activations serve: asked for, in this build, and groups of whole 4-input steps (the kernels'
 * k step), at most 256 inputs, dividing K; every code width (4, 5, 6 and 8 bits). */
static int a8_serves(int act8, int64_t K, int64_t g) {
    return act8 && lmi_arch_q_a8_rows() && g % 4 == 0 && g <= 256 && K % g == 0;
}

/* Rows [row, row + rows) x panel p. A chunk of more than lmi_arch_q_rows() rows (nb > 1 or rows > it)
 * with per-thread panels W: the panel dequantized once (by its first row block, i == 0) into this
 * thread's W, then kernels/cpu_gemm.c's fp32 row block over it (the same values, the same order);
 * else the register kernels, which dequantize as they multiply. */
static void q_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const q_ctx *c = (const q_ctx *)v;
    const int64_t K = c->K, mrq = lmi_arch_q_rows();
    const lmi_qsrc s = qsrc_panel(c->smode, c->S, c->Mn, c->D, c->E, c->sg, c->G, p);
    const uint8_t *B = c->Bp + p * c->pbytes, *Bn = next ? B + c->pbytes : 0;
    const int64_t ncols = c->N - p * NR < NR ? c->N - p * NR : NR;
    const float *bias = c->bias ? c->bias + p * NR : 0;
    float *C = c->C + row * c->ldc + p * NR;
    if (c->W && (nb > 1 || rows > mrq)) {
        float *W = c->W + (int64_t)omp_get_thread_num() * K * NR;
        if (i == 0) lmi_arch_q_dequant(B, K, c->g, &s, c->bits, W, Bn);
        lmi_arch_gemm_block_cached((const float *)lmi_panel_pad_row(&c->pad, row), c->pad.ldp_bytes / 4, W, K, C,
                                   c->ldc, bias, ncols, rows);
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += mrq) {   /* (more than one pass only if W's allocation failed) */
        const int64_t mr = rows - r0 < mrq ? rows - r0 : mrq;
        lmi_arch_q_block((const float *)lmi_panel_pad_row(&c->pad, row + r0), c->pad.ldp_bytes / 4, B, K, c->g, &s,
                         C + r0 * c->ldc, c->ldc, bias, ncols,
                         r0 == 0 ? Bn : 0, c->pbytes >> 6, i, nb, c->bits, mr);
    }
}

/* A [M, K] fp32 at row stride lda (K contiguous); Bp, S, Mn, D, E as packed (see the top), smode
 * and sg their mode; bits 4, 5, 6 or 8; g the group size along K; bias [N] or NULL; C [M, N] at row
 * stride ldc. kernels/cpu_panel.h's loop (threads own contiguous ranges of panels; rows in chunks
 * whose A slice stays in L2, about 1 MiB). Up to lmi_arch_q_rows() rows a chunk: dequantized in
 * registers as they multiply; more: each panel dequantized once into W (K x 128 bytes, L2), then the
 * fp32 row blocks of up to lmi_arch_q_dequant_rows() rows. act8: int8 activations where this build has
 * them and the weight qualifies (a8_serves); the layer's own setting (its pack), never the process's. */
void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const void *S,
                const void *Mn, const float *D, const float *E, int smode, int64_t sg, int bits, int64_t g,
                int64_t N, const float *bias, float *C, int64_t ldc, int act8, int nthreads) {
    const int64_t np = (N + NR - 1) / NR, mrq = lmi_arch_q_rows();
    q_ctx c = {{0}, A, bias, D, E, Bp, S, Mn, C, 0, lda, K, N, ldc, g, (K + g - 1) / g, sg, K * LMI_Q_ROW_BYTES(bits),
               smode, bits, 0, 0, 0, 0, 0};
    if (a8_serves(act8, K, g) && gemm_q_a8(&c, M, np, nthreads)) return;
    const int64_t mr = M > mrq ? lmi_arch_q_dequant_rows() : mrq;
    if (M > mrq) c.W = (float *)aligned_alloc(64, (size_t)team(nthreads, np) * (size_t)K * NR * sizeof(float));
    lmi_panel_drive_rows(&c.pad, A, M, K * 4, lda * 4, np, mr, nthreads, q_block, &c);
    free(c.W);
}
