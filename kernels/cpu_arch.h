/* What the architecture layer gives the generic kernels: row blocks of the panel GEMMs that other
 * sources reuse. Internal to the library (hidden: not entry points of kernels/cpu_api.h). */
#ifndef LMI_CPU_ARCH_H
#define LMI_CPU_ARCH_H
#include <stdint.h>

#define LMI_HIDDEN __attribute__((visibility("hidden")))

/* fp32 panels (kernels/cpu_gemm.c's lmi_pack_b): rows (1..lmi_arch_gemm_rows()) of A (row stride lda)
 * x one panel B [K][32] -> C (row stride ldc), its first ncols (<= 32) columns, + bias (or NULL):
 * each output summed in k order by FMAs from 0, then + bias. Bn (or NULL): the next panel, whose
 * k-rows pf0, pf0 + pfs, ... this block prefetches into L2. */
LMI_HIDDEN int lmi_arch_gemm_rows(void);
LMI_HIDDEN void lmi_arch_gemm_block(const float *A, int64_t lda, const float *B, int64_t K, float *C, int64_t ldc,
                                    const float *bias, int64_t ncols, const float *Bn, int64_t pf0, int64_t pfs,
                                    int64_t rows);
#endif
