/* bf16 <-> fp32 as torch converts them (shared by the CPU kernels' sources). */
#ifndef LMI_CPU_BF16_H
#define LMI_CPU_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch does */
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);   /* NaN stays NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
#endif
