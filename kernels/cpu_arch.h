/* The architecture layer's interface: what kernels/x86/ (AVX-512, AVX2) and kernels/arm/ (NEON) each
 * define, and the generic sources (the drivers on kernels/cpu_panel.h, the layer stack) call. Every
 * build compiles the generic sources and one folder (kernels/cpu/build.py, by kernels/isa.py's
 * family): the same names, one definition each. Internal to the library (hidden: not entry points of
 * kernels/cpu_api.h).
 *
 * A row block is `rows` (1..the family's *_rows()) rows of the activations x one panel of 32 output
 * columns, its first ncols (<= 32) stored, + bias (or NULL). Bn (or NULL): the thread's next panel,
 * whose lines pf0, pf0 + pfs, ... this block prefetches into L2 (kernels/cpu_panel.h: a panel's nb row
 * blocks share the prefetching). Each build sums every output in the same order (the GEMMs: k order
 * by FMAs from 0, then + bias), so every build gives the same values bit for bit. */
#ifndef LMI_CPU_ARCH_H
#define LMI_CPU_ARCH_H
#include <stdint.h>

#include "cpu_panel.h"

#define LMI_HIDDEN __attribute__((visibility("hidden")))

/* ---- fp32 panels (kernels/cpu_gemm.c): B [K][32] */
LMI_HIDDEN int lmi_arch_gemm_rows(void);
LMI_HIDDEN void lmi_arch_gemm_block(const float *A, int64_t lda, const float *B, int64_t K, float *C, int64_t ldc,
                                    const float *bias, int64_t ncols, const float *Bn, int64_t pf0, int64_t pfs,
                                    int64_t rows);
/* the same values for a panel already in the caches (one just written, e.g. a dequantized one): no prefetching */
LMI_HIDDEN void lmi_arch_gemm_block_cached(const float *A, int64_t lda, const float *B, int64_t K, float *C,
                                           int64_t ldc, const float *bias, int64_t ncols, int64_t rows);

/* ---- bf16 panels (kernels/cpu_gemm_bf16.c): B [ceil(K/2)][32][2]; C fp32, or bf16 when out_bf16.
 * Widened (fp32 A, every build) and dot-product (bf16 A, vdpbf16ps: lmi_arch_bf16_rows() is 0 without). */
LMI_HIDDEN int lmi_arch_bf16w_rows(void);
LMI_HIDDEN void lmi_arch_bf16w_block(const float *A, int64_t lda, const uint16_t *B, int64_t K, void *C, int64_t ldc,
                                     int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn, int64_t pf0,
                                     int64_t pfs, int64_t rows);
LMI_HIDDEN int lmi_arch_bf16_rows(void);
LMI_HIDDEN void lmi_arch_bf16_block(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t K, void *C,
                                    int64_t ldc, int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn,
                                    int64_t pf0, int64_t pfs, int64_t rows);
LMI_HIDDEN void lmi_arch_bf16_round_row(const float *a, int64_t K, uint16_t *o);   /* where lmi_arch_bf16_rows() */

/* ---- int8 (kernels/cpu_gemm_i8.c): activations Aq [M][Kp] uint8 (q + 128), panels [kq][32][4] */
typedef struct {
    lmi_panel_pad A;            /* first: lmi_panel_pad_prep's. Aq as the blocks read it (lmi_panel_pad_row) */
    const uint8_t *Aq;
    int16_t *A16;               /* widened builds: the chunk's rows as lmi_arch_i8_widen left them, lda16 apart */
    const float *sa, *sw, *bias;
    const int8_t *Bp;
    const int32_t *wsum;
    float *C;
    int64_t Kp, kq, N, ldc, chunk, lda16;
} lmi_i8_args;
/* Row `row` of the activation bytes as the blocks read it (c->A.ldp_bytes apart) */
static inline const uint8_t *lmi_i8_row(const lmi_i8_args *c, int64_t row) {
    return (const uint8_t *)lmi_panel_pad_row(&c->A, row);
}
/* the row quantization's vector part, for k < n (a multiple of 16): max |a[k]| (0 for n = 0), reduced in
 * the order of gcc's _mm512_reduce_max_ps; o[k] = clamp(round_even(a[k] * inv), -127, 127) + 128 */
LMI_HIDDEN float lmi_arch_i8_absmax(const float *a, int64_t n);
LMI_HIDDEN void lmi_arch_i8_quant(const float *a, int64_t n, float inv, uint8_t *o);
LMI_HIDDEN int lmi_arch_i8_rows(void);
/* 1: the blocks of 2+ rows read c->A16, each chunk's rows widened by lmi_arch_i8_widen first (the
 * loop's prep), row r of the chunk at A16 + (r % chunk) * Kp */
LMI_HIDDEN int lmi_arch_i8_widened(void);
LMI_HIDDEN void lmi_arch_i8_widen(const uint8_t *Aq, int64_t rows, int64_t Kp, int16_t *out, int64_t ldo);
LMI_HIDDEN void lmi_arch_i8_block(const lmi_i8_args *c, int64_t row, int64_t rows, int64_t p, int next, int64_t i,
                                  int64_t nb);

/* ---- grouped 4/5/6/8-bit codes (kernels/cpu_gemm_q4.c, whose top gives the layout) */
#define LMI_Q_ROW_BYTES(BITS) ((BITS) == 8 ? 32 : 16 + 4 * ((BITS) - 4))     /* one packed row k of a panel */
/* The cache-line step of the codes stream: true for the one row k of each 64-byte line that starts
 * in the line's first RB bytes (every line holds at least two rows' starts for RB <= 32). */
#define LMI_Q_LINE_START(k, RB) ((((k) * (RB)) & 63) < (RB))
/* One panel's scale source: S, Mn (fp32, fp16 or int8 by mode), D, E (QS_I8: one per sg groups). */
typedef struct {
    int mode;
    const uint8_t *s, *m;
    const float *d, *e;
    int64_t sg;
} lmi_qsrc;
LMI_HIDDEN int lmi_arch_q_rows(void);            /* rows dequantized in registers as they multiply */
LMI_HIDDEN int lmi_arch_q_dequant_rows(void);    /* past those: fp32 row blocks over a dequantized panel */
LMI_HIDDEN void lmi_arch_q_block(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g,
                                 const lmi_qsrc *c, float *C, int64_t ldc, const float *bias, int64_t ncols,
                                 const uint8_t *Bn, int64_t Bn_lines, int64_t pf0, int64_t pfs, int bits, int64_t rows);
/* the panel's weights fma(q, s, m) into W [K][32] fp32 (64-byte aligned); Bn's codes prefetched meanwhile */
LMI_HIDDEN void lmi_arch_q_dequant(const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, int bits, float *W,
                                   const uint8_t *Bn);
/* int8 activations (act8; lmi_arch_q_a8_rows() is 0 where the build has none): a row quantized per group
 * (aq, da, sa, si); MR rows x one panel (B: its codes, or with `transposed` the panel as
 * lmi_arch_q_a8_transpose left it in T, K x 32 bytes 64-byte aligned, where lmi_arch_q_a8_transposed_rows(bits),
 * the rows a block over it, is not 0 for the codes' width) */
LMI_HIDDEN int lmi_arch_q_a8_rows(void);
LMI_HIDDEN int lmi_arch_q_a8_transposed_rows(int bits);
LMI_HIDDEN void lmi_arch_q_a8_row(const float *a, int64_t K, int64_t g, int8_t *aq, float *da, float *sa, int32_t *si);
LMI_HIDDEN void lmi_arch_q_a8_transpose(const uint8_t *B, int64_t K, int bits, void *T, const uint8_t *Bn);
LMI_HIDDEN void lmi_arch_q_a8_block(const int8_t *aq, const float *da, const float *sa, const int32_t *si, int64_t G,
                                    const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, float *C, int64_t ldc,
                                    const float *bias, int64_t ncols, const uint8_t *Bn, int transposed, int bits,
                                    int64_t rows);

/* ---- torch's Vectorized<float> for kernels/cpu_layer.c's SiLU and bf16 element-wise steps: whole
 * vectors only (each returns how many elements it did, from 0; the caller does the rest one by one) */
LMI_HIDDEN int lmi_arch_vec_lanes(void);         /* 16 on AVX-512, 8 on AVX2, 4 on NEON */
LMI_HIDDEN void lmi_arch_set_expf(void *fn);     /* Sleef's expf for lmi_arch_vec_lanes() lanes, or NULL */
LMI_HIDDEN int lmi_arch_has_expf(void);
LMI_HIDDEN int64_t lmi_arch_silu_f32(float *g, int64_t n);          /* two vectors a loop, as torch's */
LMI_HIDDEN int64_t lmi_arch_silu_bf16(uint16_t *g, int64_t n);      /* four vectors a loop */
LMI_HIDDEN int64_t lmi_arch_bf16_binary(uint16_t *g, const uint16_t *u, int64_t n, int add);
#endif
