/* The fp32 panel GEMM's row blocks on aarch64 NEON (kernels/cpu_arch.h's lmi_arch_gemm_*; kernels/cpu_gemm.c
 * drives them): kernels/cpu_v8.h's 8-lane blocks of up to 3 rows, the x86 builds' values bit for bit. */
#include <stdint.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32
#define LMI_V8_GEMM
#include "../cpu_v8.h"

int lmi_arch_gemm_rows(void) { return V8_GEMM_ROWS; }

void lmi_arch_gemm_block(const float *A, int64_t lda, const float *B, int64_t K, float *C, int64_t ldc,
                         const float *bias, int64_t ncols, const float *Bn, int64_t pf0, int64_t pfs, int64_t rows) {
    V8_GEMM[rows](A, lda, B, K, C, ldc, bias, ncols, Bn, pf0, pfs);
}

void lmi_arch_gemm_block_cached(const float *A, int64_t lda, const float *B, int64_t K, float *C, int64_t ldc,
                                const float *bias, int64_t ncols, int64_t rows) {
    V8_GEMM_CACHED[rows](A, lda, B, K, C, ldc, bias, ncols, 0, 0, 1);
}
