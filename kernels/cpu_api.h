/* The CPU kernels' entry points one source calls in another (they are linked into one library:
 * kernels/cpu_ext.py). */
#ifndef LMI_CPU_API_H
#define LMI_CPU_API_H
#include <stdint.h>

/* Before a loop over a register block's rows: unrolled, the block's accumulator arrays stay in
 * registers (rolled, gcc kept them on the stack: a memset and stalled reloads per block, ~2-4% of
 * a GEMM at prompt sizes). */
#define UNROLL_MR _Pragma("GCC unroll 16")

void lmi_pack_b(const float *W, int64_t N, int64_t K, float *out);
void lmi_pack_bf16(const uint16_t *W, int64_t N, int64_t K, uint16_t *out);
void lmi_gemm(const float *A, int64_t M, int64_t K, int64_t lda, const float *Bp, int64_t N, const float *bias,
              float *C, int64_t ldc, int nthreads);
void lmi_gemm_bf16(const uint16_t *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                   const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads);
void lmi_gemm_bf16w(const float *A, int64_t M, int64_t K, int64_t lda, const uint16_t *Bp, int64_t N,
                    const float *bias, void *C, int64_t ldc, int out_bf16, int nthreads);
void lmi_quant_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint8_t *out, int64_t Kp, float *scales,
                    int nthreads);
void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp, const int32_t *wsum,
                 const float *sw, int64_t N, const float *bias, float *C, int64_t ldc, int nthreads);
void lmi_rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t H, float eps, int W,
                      float *sq);
void lmi_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t H, float eps,
                       int nthreads);
int lmi_decode_fused(void *q, void *k, void *v, int64_t qs, int64_t ks, int64_t vs, const void *cos,
                     const void *sin, int64_t cs, int bf16, void *kc, void *vc, int64_t s_blk, int64_t s_tok,
                     int64_t s_head, const int64_t *slots, int64_t nslots, const int32_t *tables, int64_t tw,
                     const int32_t *lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                     int64_t window, float softcap, void *out, int nthreads);
int lmi_write_kv(void *kc, void *vc, const void *key, const void *value, int64_t elem, int64_t s_blk, int64_t s_tok,
                 int64_t s_head, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head, const int64_t *slots,
                 int64_t T, int64_t Hkv, int64_t D, int64_t bs, int64_t nslots);
void lmi_rotary(void *q, void *k, const void *cos, const void *sin, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                int64_t qs, int64_t ks, int64_t cs, int bf16, int nthreads);
int lmi_prefill_attention(const void *q, const void *k, const void *v, int64_t qs, int64_t ks, int64_t vs, int64_t qh,
                          int64_t khs, int64_t vhs, void *out, int64_t os, int64_t oh, int bf16, const int64_t *starts,
                          const int64_t *lens, const int64_t *order, int64_t P, int64_t H, int64_t Hkv, int64_t D,
                          float scale, int nthreads);
#endif
