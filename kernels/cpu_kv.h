/* The int8 KV pool's format, one definition for every C file (kernels/cpu_kv.c) and for Python
 * (kernels/pool.py, whose oracle functions give the same bytes): a pool [NB, bs, Hkv, D] of int8
 * rows, each (token, head) row quantized symmetrically with its own fp32 scale, the scales
 * [NB, bs, Hkv] laid out alike (a row's scale at its element offset / D). */
#ifndef LMI_CPU_KV_H
#define LMI_CPU_KV_H
#include <stdint.h>

/* Rows x [T, Hkv, D] (row t's head h at x + t * tok + h * D elements, fp32 or bf16) replaced in
 * place by what an int8 pool stores of them, dequantized; q: D bytes of scratch. Internal to the
 * library (hidden: not an entry point of kernels/cpu_api.h). */
__attribute__((visibility("hidden")))
void lmi_kv_i8_roundtrip(void *x, int bf16, int64_t T, int64_t Hkv, int64_t D, int64_t tok, int8_t *q);

#endif
