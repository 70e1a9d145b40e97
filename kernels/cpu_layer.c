/* A CPU step's decoder stack in one call (decode rows, then whole prompts): for each layer, Llama's
 *
 *     x = norm1(h); q|k|v = x W_qkv; a = attention (kernels/cpu_decode.c: lmi_decode_fused for the
 *     decode rows; lmi_rotary, lmi_write_kv and lmi_prefill_attention for the prompts' rows);
 *     h += a W_o; x = norm2(h); g|u = x W_gu; h += (silu(g) * u) W_down
 *
 * calling the same kernels the Python layer calls one by one (the panel GEMMs of cpu_gemm.c,
 * cpu_gemm_bf16.c, cpu_gemm_i8.c and cpu_gemm_q4.c, the norms, the fused attention), with the
 * element-wise steps rounded as torch rounds them: the same values bit for bit
 * (tests/model/test_cpu_stack.py, test_cpu_stack_quant.py), one Python call per step instead of
 * about twenty per layer.
 *
 * SiLU is torch's: torch computes x / (1 + exp(-x)) with Sleef's expf (u10) on whole vectors and
 * glibc's expf on a loop's tail, the loop split across threads in chunks of at::parallel_for. The
 * caller hands in the Sleef function torch itself links for its vector width (lmi_set_sleef_expf:
 * Sleef_expf16_u10 on AVX-512, Sleef_expf8_u10 on AVX2, Sleef_expf4_u10 on NEON) and this file
 * repeats that split; kernels/cpu/ checks the result against torch before it is used.
 * Compiled without -ffast-math and without FMA contraction (kernels/cpu/ EXACT_FLAGS). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_bf16.h"
#include "cpu_kv.h"

/* at::internal::GRAIN_SIZE, elements: torch runs smaller loops on one thread, and so does this file */
#define GRAIN 32768

/* lmi_lin, lmi_layer and the LIN_* kinds: kernels/cpu_api.h */

/* ---------------------------------------------------------------- torch's SiLU */
/* One vector of VW floats per ISA (torch's Vectorized<float>: 16 lanes on AVX-512, 8 on AVX2, 4 on
 * NEON; Vectorized<BFloat16> holds 2 * VW), with the bf16 conversions of cpu_bf16.h lane by lane. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vneg(vf x) { return _mm512_sub_ps(_mm512_setzero_ps(), x); }    /* a sign flip for exp */
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vone(void) { return _mm512_set1_ps(1.0f); }

static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 floats -> bf16, f32_to_bf16's rounding (to nearest even; a NaN stays a NaN) lane by lane. */
static inline void vstore_bf16(uint16_t *p, vf x) {
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vneg(vf x) { return _mm256_xor_ps(_mm256_set1_ps(-0.0f), x); }     /* torch's neg() */
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vone(void) { return _mm256_set1_ps(1.0f); }

static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void vstore_bf16(uint16_t *p, vf x) {
    const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    /* |u| > inf's bits: a NaN (both sides below 2^31, so the signed compare is the unsigned one) */
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i v = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    /* every lane is below 2^16: the unsigned-saturating pack keeps it as is */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
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
#endif

#ifdef VW
typedef vf (*expf_t)(vf);
static expf_t sleef_expf;

/* torch's Sleef exp of VW lanes (Sleef_expf16_u10 / Sleef_expf8_u10 / Sleef_expf4_u10, the one
 * libtorch_cpu links for its CPU capability); `lanes` another width than this build's: no SiLU. */
void lmi_set_sleef_expf(void *fn, int lanes) { sleef_expf = lanes == VW ? (expf_t)fn : 0; }
void lmi_set_sleef_expf16(void *fn) { lmi_set_sleef_expf(fn, 16); }
int lmi_silu_available(void) { return sleef_expf != 0; }
int lmi_silu_lanes(void) { return VW; }

static inline vf silu_v(vf x) { return vdiv(x, vadd(vone(), sleef_expf(vneg(x)))); }

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

/* torch's vectorized_loop over [0, n): two vectors per iteration, the rest by the scalar op. */
static void silu_range_f32(float *g, int64_t n) {
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        vstore(g + i, silu_v(vload(g + i)));
        vstore(g + i + VW, silu_v(vload(g + i + VW)));
    }
    for (; i < n; ++i) g[i] = silu1(g[i]);
}

static void silu_range_bf16(uint16_t *g, int64_t n) {
    int64_t i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW)    /* Vectorized<BFloat16> is 2 * VW wide: two a loop, as float pairs */
        for (int j = 0; j < 4 * VW; j += VW)
            vstore_bf16(g + i + j, silu_v(vload_bf16(g + i + j)));
    for (; i < n; ++i) g[i] = f32_to_bf16(silu1(bf16_to_f32(g[i])));
}

/* g[i] <- round(g[i] * u[i]) (bf16, products in fp32), or g[i] <- g[i] + u[i] when add. */
static void bf16_binary(uint16_t *g, const uint16_t *u, int64_t n, int add) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf a = vload_bf16(g + i), b = vload_bf16(u + i);
        vstore_bf16(g + i, add ? vadd(a, b) : vmul(a, b));
    }
    for (; i < n; ++i) {
        const float a = bf16_to_f32(g[i]), b = bf16_to_f32(u[i]);
        g[i] = f32_to_bf16(add ? a + b : a * b);
    }
}

/* at::parallel_for's split of [0, n) with GRAIN_SIZE over `threads` threads. */
static void torch_chunks(int64_t n, int threads, int64_t *chunk, int64_t *count) {
    int64_t nt = 1;
    if (n >= GRAIN && threads > 1) {
        nt = (n + GRAIN - 1) / GRAIN;
        if (nt > threads) nt = threads;
    }
    *chunk = (n + nt - 1) / nt;
    *count = nt;
}

/* In place g <- silu(g) (torch's F.silu(g, inplace=True) on a contiguous [rows * I]), then
 * g <- g * u (torch's mul_ by a [rows, I] view whose rows are ldu elements apart), fp32 or bf16. */
static void silu_mul_rows(void *g, const void *u, int64_t rows, int64_t I, int64_t ldu, int bf16, int threads) {
    const int64_t n = rows * I;
    int64_t chunk, count;
    torch_chunks(n, threads, &chunk, &count);
#pragma omp parallel for num_threads(threads) if (count > 1) schedule(static)
    for (int64_t c = 0; c < count; ++c) {
        const int64_t a = c * chunk, b = a + chunk < n ? a + chunk : n;
        if (bf16)
            silu_range_bf16((uint16_t *)g + a, b - a);
        else
            silu_range_f32((float *)g + a, b - a);
    }
#pragma omp parallel for num_threads(threads) if (n >= GRAIN) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        if (bf16) {
            bf16_binary((uint16_t *)g + r * I, (const uint16_t *)u + r * ldu, I, 0);
        } else {
            float *gg = (float *)g + r * I;
            const float *uu = (const float *)u + r * ldu;
            for (int64_t i = 0; i < I; ++i) gg[i] = gg[i] * uu[i];
        }
    }
}

void lmi_silu_mul(void *g, const void *u, int64_t n, int bf16, int threads) {
    silu_mul_rows(g, u, 1, n, n, bf16, threads);
}
#else
static void silu_mul_rows(void *g, const void *u, int64_t rows, int64_t I, int64_t ldu, int bf16, int threads) {
    (void)g; (void)u; (void)rows; (void)I; (void)ldu; (void)bf16; (void)threads;
}
void lmi_set_sleef_expf(void *fn, int lanes) { (void)fn; (void)lanes; }
void lmi_set_sleef_expf16(void *fn) { (void)fn; }
int lmi_silu_available(void) { return 0; }
int lmi_silu_lanes(void) { return 0; }
void lmi_silu_mul(void *g, const void *u, int64_t n, int bf16, int threads) {
    (void)g; (void)u; (void)n; (void)bf16; (void)threads;
}
#endif

/* ---------------------------------------------------------------- the stack */
static void widen(const uint16_t *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
}

/* y [m, n] (row stride ldy) = x [m, k] through `l`, in the activations' dtype; `ws` scratch of
 * lin_scratch bytes. */
static void linear(const lmi_lin *l, const void *x, int64_t m, void *y, int64_t ldy, int bf16, char *ws,
                   int threads) {
    const int64_t k = l->k, n = l->n;
    if (n == 0) return;
    if (l->kind == LIN_F32) {
        lmi_gemm(x, m, k, k, l->panels, n, l->bias, y, ldy, threads);
    } else if (l->kind == LIN_BF16) {
        lmi_gemm_bf16(x, m, k, k, l->panels, n, l->bias, y, ldy, 1, threads);
    } else if (l->kind == LIN_BF16W) {
        float *xf = (float *)ws;
        widen(x, xf, m * k);
        lmi_gemm_bf16w(xf, m, k, k, l->panels, n, l->bias, y, ldy, 1, threads);
    } else if (l->kind == LIN_Q) {  /* Q4Linear: fp32 rows (a bf16 row widened), fp32 out (bf16: rounded) */
        if (!bf16) {
            lmi_gemm_q(x, m, k, k, l->panels, l->qscale, l->qmin, l->qd, l->qe, (int)l->qsmode, l->qsg, (int)l->bits,
                       l->group, n, l->bias, y, ldy, (int)l->act8, threads);
            return;
        }
        float *xf = (float *)ws, *yf = xf + m * k;
        widen(x, xf, m * k);
        lmi_gemm_q(xf, m, k, k, l->panels, l->qscale, l->qmin, l->qd, l->qe, (int)l->qsmode, l->qsg, (int)l->bits,
                   l->group, n, l->bias, yf, n, (int)l->act8, threads);
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < n; ++i) ((uint16_t *)y)[r * ldy + i] = f32_to_bf16(yf[r * n + i]);
    } else {    /* LIN_I8: rows quantized from fp32 (a bf16 row widened first), the output in fp32 */
        const int64_t kp = (k + 3) / 4 * 4;
        const float *xf = x;
        char *p = ws;
        if (bf16) {
            widen(x, (float *)p, m * k);
            xf = (const float *)p;
            p += m * k * 4;
        }
        float *sa = (float *)p;
        p += m * 4;
        float *yf = bf16 ? (float *)p : y;
        if (bf16) p += m * n * 4;
        lmi_quant_rows(xf, m, k, k, (uint8_t *)p, kp, sa, threads);
        lmi_gemm_i8((const uint8_t *)p, m, kp, sa, l->panels, l->wsum, l->wscale, n, l->bias, yf, bf16 ? n : ldy,
                    threads);
        if (bf16)
            for (int64_t r = 0; r < m; ++r)
                for (int64_t i = 0; i < n; ++i) ((uint16_t *)y)[r * ldy + i] = f32_to_bf16(yf[r * n + i]);
    }
}

static int64_t lin_scratch(const lmi_lin *l, int64_t m, int bf16) {
    const int64_t kp = (l->k + 3) / 4 * 4;
    if (l->kind == LIN_BF16W) return m * l->k * 4;
    if (l->kind == LIN_Q) return bf16 ? m * (l->k + l->n) * 4 : 0;
    if (l->kind == LIN_I8) return m * l->k * 4 + m * 4 + m * l->n * 4 + m * kp;
    return 0;
}

static void residual(void *h, const void *x, int64_t n, int bf16, int threads) {
    if (bf16) {
        uint16_t *hh = h;
        const uint16_t *xx = x;
#ifdef VW
        const int nt = n >= GRAIN ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
        for (int c = 0; c < nt; ++c) {
            const int64_t a = n * c / nt / VW * VW, b = c + 1 == nt ? n : n * (c + 1) / nt / VW * VW;
            bf16_binary(hh + a, xx + a, b - a, 1);
        }
#else
#pragma omp parallel for num_threads(threads) if (n >= GRAIN) schedule(static)
        for (int64_t i = 0; i < n; ++i) hh[i] = f32_to_bf16(bf16_to_f32(hh[i]) + bf16_to_f32(xx[i]));
#endif
    } else {
        float *hh = h;
        const float *xx = x;
#pragma omp parallel for num_threads(threads) if (n >= GRAIN) schedule(static)
        for (int64_t i = 0; i < n; ++i) hh[i] += xx[i];
    }
}

/* sq: `threads` x E floats of scratch (fp32: each thread's rows take their own). */
static void norm(const void *h, const void *w, void *out, int64_t B, int64_t E, float eps, int lanes, float *sq,
                 int bf16, int threads) {
    if (bf16) {
        lmi_rms_norm_bf16(h, w, out, B, E, eps, threads);
        return;
    }
    const int nt = B * E >= GRAIN && B > 1 ? (threads < B ? threads : (int)B) : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int c = 0; c < nt; ++c) {
        const int64_t r0 = B * c / nt, r1 = B * (c + 1) / nt;
        lmi_rms_norm_f32((const float *)h + r0 * E, w, (float *)out + r0 * E, r1 - r0, E, eps, lanes, sq + c * E);
    }
}

/* h [T, E] (in place: the residual stream after the last layer) for a step of B decoding
 * sequences (rows 0 .. B-1, one each) and P whole prompts (each prompt's context is its own rows
 * of this step: rows pstarts[p] .. pstarts[p] + plens[p] - 1, all >= B; porder: the prompts
 * longest first, as lmi_prefill_attention takes them). cos/sin [T, D] (row stride cs); slots [T];
 * tables [B, tw], lens [B] as lmi_decode_fused takes them; pools share one layout (strides
 * s_blk/s_tok/s_head, elements), nslots slots each; a layer with ksc set has int8 pools
 * (lmi_decode_fused_i8, lmi_write_kv_i8). Decode rows: lmi_decode_fused (rotary, KV
 * write, attention over the pool); prompt rows: lmi_rotary, lmi_write_kv, lmi_prefill_attention
 * over their own keys: what handler/model/llama.py's layer calls for such a step.
 * Returns 0, -1 (a slot past the pool, before anything of the step was written), -2 (no memory). */
int lmi_step_layers(const lmi_layer *layers, int64_t L, void *h, int64_t T, int64_t B, int64_t E, int64_t H,
                    int64_t Hkv, int64_t D, int64_t I, float eps, int lanes, int bf16, const void *cos,
                    const void *sin, int64_t cs, const int64_t *slots, int64_t nslots, const int32_t *tables,
                    int64_t tw, const int32_t *lens, int64_t P, const int64_t *pstarts, const int64_t *plens,
                    const int64_t *porder, int64_t s_blk, int64_t s_tok, int64_t s_head, int64_t bs, float scale,
                    int threads) {
    const int64_t es = bf16 ? 2 : 4, nqkv = (H + 2 * Hkv) * D;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= nslots) return -1;
    int64_t lin = 0;
    for (int64_t l = 0; l < L; ++l) {
        const lmi_lin *ls[7] = {&layers[l].q, &layers[l].k, &layers[l].v, &layers[l].o, &layers[l].gate,
                                &layers[l].up, &layers[l].down};
        for (int j = 0; j < 7; ++j) {
            const int64_t s = lin_scratch(ls[j], T, bf16);
            if (s > lin) lin = s;
        }
    }
    /* x: normed rows; qkv; attn; o: a projection's output; gu: gate|up; act: silu(g) * u */
    if (lin < D) lin = D;   /* also an int8 row's room (lmi_kv_i8_roundtrip) */
    const int64_t sizes[] = {T * E * es, T * nqkv * es, T * H * D * es, T * E * es, T * 2 * I * es, T * I * es,
                             (int64_t)threads * E * 4, lin};
    int64_t total = 0, off[8];
    for (int j = 0; j < 8; ++j) {
        off[j] = total;
        total += (sizes[j] + 63) / 64 * 64;
    }
    char *mem = aligned_alloc(64, (size_t)(total > 0 ? total : 64));
    if (!mem) return -2;
    void *x = mem + off[0], *qkv = mem + off[1], *attn = mem + off[2], *o = mem + off[3], *gu = mem + off[4];
    void *act = mem + off[5];
    float *sq = (float *)(mem + off[6]);
    char *ws = mem + off[7];
    const int64_t np = T - B;
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; ++l) {
        const lmi_layer *ly = &layers[l];
        norm(h, ly->norm1, x, T, E, eps, lanes, sq, bf16, threads);
        char *q = qkv, *k = q + H * D * es, *v = q + (H + Hkv) * D * es;
        linear(&ly->q, x, T, q, nqkv, bf16, ws, threads);
        linear(&ly->k, x, T, q + ly->q.n * es, nqkv, bf16, ws, threads);
        linear(&ly->v, x, T, q + (ly->q.n + ly->k.n) * es, nqkv, bf16, ws, threads);
        if (B && ly->ksc)
            rc = lmi_decode_fused_i8(q, k, v, nqkv, nqkv, nqkv, cos, sin, cs, bf16, ly->kc, ly->vc, ly->ksc, ly->vsc,
                                     s_blk, s_tok, s_head, slots, nslots, tables, tw, lens, B, H, Hkv, D, bs, scale,
                                     ly->window, 0.0f, attn, threads);
        else if (B)
            rc = lmi_decode_fused(q, k, v, nqkv, nqkv, nqkv, cos, sin, cs, bf16, ly->kc, ly->vc, s_blk, s_tok,
                                  s_head, slots, nslots, tables, tw, lens, B, H, Hkv, D, bs, scale, ly->window, 0.0f,
                                  attn, threads);
        if (rc == 0 && P) {
            const int64_t qo = B * nqkv * es, co = B * cs * es;
            lmi_rotary(q + qo, k + qo, (const char *)cos + co, (const char *)sin + co, np, H, Hkv, D, nqkv, nqkv, cs,
                       bf16, threads);
            if (ly->ksc) {  /* int8 pools: the rows stored quantized, and the prompt attends to what they hold */
                lmi_write_kv_i8(ly->kc, ly->vc, ly->ksc, ly->vsc, k + qo, v + qo, bf16, s_blk, s_tok, s_head, nqkv,
                                D, nqkv, D, slots + B, np, Hkv, D, bs, nslots);
                lmi_kv_i8_roundtrip(k + qo, bf16, np, Hkv, D, nqkv, (int8_t *)ws);
                lmi_kv_i8_roundtrip(v + qo, bf16, np, Hkv, D, nqkv, (int8_t *)ws);
            } else
                lmi_write_kv(ly->kc, ly->vc, k + qo, v + qo, es, s_blk, s_tok, s_head, nqkv, D, nqkv, D, slots + B,
                             np, Hkv, D, bs, nslots);
            rc = lmi_prefill_attention(q, k, v, nqkv, nqkv, nqkv, D, D, D, attn, H * D, D, bf16, pstarts, plens,
                                       porder, P, H, Hkv, D, scale, threads);
        }
        if (rc) break;
        linear(&ly->o, attn, T, o, E, bf16, ws, threads);
        residual(h, o, T * E, bf16, threads);
        norm(h, ly->norm2, x, T, E, eps, lanes, sq, bf16, threads);
        linear(&ly->gate, x, T, gu, 2 * I, bf16, ws, threads);
        linear(&ly->up, x, T, (char *)gu + ly->gate.n * es, 2 * I, bf16, ws, threads);
        /* gate's half of each row copied out (as the Python layer's .contiguous()), times up's half in place */
#pragma omp parallel for num_threads(threads) if (T * I >= GRAIN) schedule(static)
        for (int64_t b = 0; b < T; ++b)
            memcpy((char *)act + b * I * es, (char *)gu + b * 2 * I * es, (size_t)(I * es));
        silu_mul_rows(act, (char *)gu + I * es, T, I, 2 * I, bf16, threads);
        linear(&ly->down, act, T, o, E, bf16, ws, threads);
        residual(h, o, T * E, bf16, threads);
    }
    free(mem);
    return rc;
}
