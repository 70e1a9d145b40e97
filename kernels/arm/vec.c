/* torch's Vectorized<float> on aarch64 NEON for kernels/cpu_layer.c (kernels/cpu_arch.h's lmi_arch_vec_*,
 * _silu_*, _bf16_binary): 4 lanes, with the bf16 conversions of cpu_bf16.h lane by lane; the loops are
 * kernels/cpu_v8.h's (LMI_VEC_LOOPS). */
#include <stdint.h>

#include <arm_neon.h>

#include "../cpu_arch.h"

#define VW 4
typedef float32x4_t vf;
static inline vf vload(const float *p) { return vld1q_f32(p); }
static inline void vstore(float *p, vf x) { vst1q_f32(p, x); }
static inline vf vneg(vf x) { return vnegq_f32(x); }
static inline vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vdiv(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vone(void) { return vdupq_n_f32(1.0f); }

static inline vf vload_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

static inline void vstore_bf16(uint16_t *p, vf x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x), hi = vshrq_n_u32(u, 16);
    const uint32x4_t lsb = vandq_u32(hi, vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    vst1_u16(p, vmovn_u32(vbslq_u32(nan, vorrq_u32(hi, vdupq_n_u32(0x40)), r)));
}

#define LMI_VEC_LOOPS
#include "../cpu_v8.h"
