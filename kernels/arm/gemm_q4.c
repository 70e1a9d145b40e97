/* The grouped-weight GEMM's aarch64 NEON kernels (kernels/cpu_arch.h's lmi_arch_q_*; kernels/cpu_gemm_q4.c
 * drives them): kernels/cpu_v8.h's 8-lane kernels, the x86 builds' values bit for bit. No int8-activation
 * kernels (lmi_arch_q_a8_rows() is 0: act8 is ignored, the exact path serves). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32
#define ROW_BYTES LMI_Q_ROW_BYTES
#define LINE_START LMI_Q_LINE_START
typedef lmi_qsrc qsrc;

#define LMI_V8_Q
#include "../cpu_v8.h"

#define KQ V8_Q
#define MRQ V8_Q_ROWS
#define MRF V8_Q_DEQUANT_ROWS
#define DEQUANT v8_q_dequant

int lmi_arch_q_rows(void) { return MRQ; }
int lmi_arch_q_dequant_rows(void) { return MRF; }

void lmi_arch_q_block(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g,
                      const lmi_qsrc *c, float *C, int64_t ldc, const float *bias, int64_t ncols,
                      const uint8_t *Bn, int64_t Bn_lines, int64_t pf0, int64_t pfs, int bits, int64_t rows) {
    KQ[bits == 8 ? 3 : bits - 4][rows](A, lda, B, K, g, c, C, ldc, bias, ncols, Bn, Bn_lines, pf0, pfs);
}

void lmi_arch_q_dequant(const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, int bits, float *W,
                        const uint8_t *Bn) {
    DEQUANT(B, K, g, c, bits, W, Bn);
}

int lmi_arch_q_a8_rows(void) { return 0; }
int lmi_arch_q_a8_transposed_rows(int bits) { (void)bits; return 0; }

void lmi_arch_q_a8_row(const float *a, int64_t K, int64_t g, int8_t *aq, float *da, float *sa, int32_t *si) {
    (void)a; (void)K; (void)g; (void)aq; (void)da; (void)sa; (void)si;
}

void lmi_arch_q_a8_transpose(const uint8_t *B, int64_t K, int bits, void *T, const uint8_t *Bn) {
    (void)B; (void)K; (void)bits; (void)T; (void)Bn;
}

void lmi_arch_q_a8_block(const int8_t *aq, const float *da, const float *sa, const int32_t *si, int64_t G,
                         const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, float *C, int64_t ldc,
                         const float *bias, int64_t ncols, const uint8_t *Bn, int transposed, int bits,
                         int64_t rows) {
    (void)aq; (void)da; (void)sa; (void)si; (void)G; (void)B; (void)K; (void)g; (void)c; (void)C; (void)ldc;
    (void)bias; (void)ncols; (void)Bn; (void)transposed; (void)bits; (void)rows;
}
