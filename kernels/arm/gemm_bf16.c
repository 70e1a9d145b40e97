/* The bf16 panel GEMMs' row blocks on aarch64 NEON (kernels/cpu_arch.h's lmi_arch_bf16*;
 * kernels/cpu_gemm_bf16.c drives them): kernels/cpu_v8.h's widening blocks of up to 2 rows, the x86
 * builds' values bit for bit. No bf16 dot-product kernels (lmi_arch_bf16_rows() is 0): the widened
 * panels serve bf16 models. */
#include <stdint.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32
#define LMI_V8_BF16W
#include "../cpu_v8.h"

int lmi_arch_bf16w_rows(void) { return V8_BF16W_ROWS; }

void lmi_arch_bf16w_block(const float *A, int64_t lda, const uint16_t *B, int64_t K, void *C, int64_t ldc,
                          int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn, int64_t pf0,
                          int64_t pfs, int64_t rows) {
    V8_BF16W[rows](A, lda, B, K, C, ldc, out_bf16, bias, ncols, Bn, pf0, pfs);
}

int lmi_arch_bf16_rows(void) { return 0; }

void lmi_arch_bf16_round_row(const float *a, int64_t K, uint16_t *o) { (void)a; (void)K; (void)o; }

void lmi_arch_bf16_block(const uint16_t *A, int64_t lda, const uint16_t *B, int64_t K, void *C, int64_t ldc,
                          int out_bf16, const float *bias, int64_t ncols, const uint16_t *Bn, int64_t pf0,
                          int64_t pfs, int64_t rows) {
    (void)A; (void)lda; (void)B; (void)K; (void)C; (void)ldc; (void)out_bf16; (void)bias; (void)ncols; (void)Bn;
    (void)pf0; (void)pfs; (void)rows;
}
