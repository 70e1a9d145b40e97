/* A CPU step's decoder stack in one call (decode rows, then whole prompts), and a step's rows through
 * the experts of a mixture-of-experts MLP (lmi_moe_experts, at the end). The stack, for each layer, Llama's
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

#include <omp.h>

#include "cpu_api.h"
#include "cpu_arch.h"
#include "cpu_bf16.h"
#include "cpu_kv.h"

/* at::internal::GRAIN_SIZE, elements: torch runs smaller loops on one thread, and so does this file */
#define GRAIN 32768

/* lmi_lin, lmi_layer and the LIN_* kinds: kernels/cpu_api.h */

/* ---------------------------------------------------------------- torch's SiLU */
/* torch's Vectorized<float> (16 lanes on AVX-512, 8 on AVX2, 4 on NEON; Vectorized<BFloat16> holds
 * twice as many) is the arch layer's (kernels/cpu_arch.h's lmi_arch_vec_lanes), the scalar rest here. */
/* torch's Sleef exp of lmi_silu_lanes() lanes (Sleef_expf16_u10 / Sleef_expf8_u10 / Sleef_expf4_u10, the one
 * libtorch_cpu links for its CPU capability); `lanes` another width than this build's: no SiLU. */
void lmi_set_sleef_expf(void *fn, int lanes) { lmi_arch_set_expf(lanes == lmi_arch_vec_lanes() ? fn : 0); }
void lmi_set_sleef_expf16(void *fn) { lmi_set_sleef_expf(fn, 16); }
int lmi_silu_available(void) { return lmi_arch_has_expf(); }
int lmi_silu_lanes(void) { return lmi_arch_vec_lanes(); }

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

/* torch's vectorized_loop over [0, n): the arch layer's whole vectors, the rest by the scalar op. */
static void silu_range_f32(float *g, int64_t n) {
    for (int64_t i = lmi_arch_silu_f32(g, n); i < n; ++i) g[i] = silu1(g[i]);
}

static void silu_range_bf16(uint16_t *g, int64_t n) {
    for (int64_t i = lmi_arch_silu_bf16(g, n); i < n; ++i) g[i] = f32_to_bf16(silu1(bf16_to_f32(g[i])));
}

/* g[i] <- round(g[i] * u[i]) (bf16, products in fp32), or g[i] <- g[i] + u[i] when add. */
static void bf16_binary(uint16_t *g, const uint16_t *u, int64_t n, int add) {
    for (int64_t i = lmi_arch_bf16_binary(g, u, n, add); i < n; ++i) {
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
    /* inside an enclosing parallel region (lmi_moe_experts' experts) the same chunks run on this thread */
    const int nested = omp_in_parallel();
#pragma omp parallel for num_threads(threads) if (count > 1 && !nested) schedule(static)
    for (int64_t c = 0; c < count; ++c) {
        const int64_t a = c * chunk, b = a + chunk < n ? a + chunk : n;
        if (bf16)
            silu_range_bf16((uint16_t *)g + a, b - a);
        else
            silu_range_f32((float *)g + a, b - a);
    }
#pragma omp parallel for num_threads(threads) if (n >= GRAIN && !nested) schedule(static)
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
        const int64_t VW = lmi_arch_vec_lanes();
        const int nt = n >= GRAIN ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
        for (int c = 0; c < nt; ++c) {
            const int64_t a = n * c / nt / VW * VW, b = c + 1 == nt ? n : n * (c + 1) / nt / VW * VW;
            bf16_binary(hh + a, xx + a, b - a, 1);
        }
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

/* q/k norms in place on each row's q and k of the fused buffer (rows nqkv elements apart), before rotary:
 * QK_HEAD one RMSNorm per head over D (Qwen3), QK_FULL one over the projection (OLMoE), with the rounding
 * handler/model/llama.py's Attention gets from the same kernels (its views made contiguous: fp32 rows
 * summed as torch sums them at q_lanes / k_lanes, bf16 as lmi_rms_norm_bf16). sq: threads x sqn floats. */
static void qk_norms(const lmi_layer *ly, char *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t nqkv,
                     float eps, int bf16, float *sq, int64_t sqn, int threads) {
    const int64_t es = bf16 ? 2 : 4, full = ly->qk_norm == QK_FULL;
    const int64_t qr = full ? 1 : H, qc = full ? H * D : D, kr = full ? 1 : Hkv, kc = full ? Hkv * D : D;
    const int nt = T * nqkv >= GRAIN && T > 1 ? (threads < T ? threads : (int)T) : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int c = 0; c < nt; ++c) {
        float *s = sq + c * sqn;
        for (int64_t t = T * c / nt; t < T * (c + 1) / nt; ++t) {
            char *q = qkv + t * nqkv * es, *k = q + H * D * es;
            if (bf16) {
                lmi_rms_norm_bf16((uint16_t *)q, ly->qn, (uint16_t *)q, qr, qc, eps, 1);
                lmi_rms_norm_bf16((uint16_t *)k, ly->kn, (uint16_t *)k, kr, kc, eps, 1);
            } else {
                lmi_rms_norm_f32((const float *)q, ly->qn, (float *)q, qr, qc, eps, (int)ly->q_lanes, s);
                lmi_rms_norm_f32((const float *)k, ly->kn, (float *)k, kr, kc, eps, (int)ly->k_lanes, s);
            }
        }
    }
}

static int moe_mlp(const lmi_layer *ly, const void *x, int64_t T, int64_t E, int bf16, void *out, char *ms,
                   void *gu, void *act, char *ws, int threads);
static void expert_rows(const lmi_lin *gate, const lmi_lin *up, const lmi_lin *down, const char *xs, int64_t c,
                        char *gu, char *act, char *y, char *ws, int64_t E, int bf16, int gemm_threads,
                        int threads);

/* h [T, E] (in place: the residual stream after the last layer) for a step of B decoding
 * sequences (rows 0 .. B-1, one each) and P prompts or prompt chunks (rows pstarts[p] .. pstarts[p] +
 * plens[p] - 1, all >= B; porder: the order lmi_prefill_attention takes them in, costliest first; pctx
 * (NULL: every prompt whole, its context its own rows): the positions before each chunk's rows, whose
 * keys the chunk reads from the layer's pools through its block table, ptables [P, ptw]: lmi_kv_ctx).
 * cos/sin [T, D] (row stride cs); slots [T];
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
                    const int64_t *porder, const int64_t *pctx, const int32_t *ptables, int64_t ptw, int64_t s_blk,
                    int64_t s_tok, int64_t s_head, int64_t bs, float scale, int threads) {
    const int64_t es = bf16 ? 2 : 4, nqkv = (H + 2 * Hkv) * D;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= nslots) return -1;
    int64_t lin = 0, Iw = I, X = 0, K = 0;     /* Iw: gu's and act's width, a shared expert's too */
    for (int64_t l = 0; l < L; ++l) {
        const lmi_lin *ls[10] = {&layers[l].q, &layers[l].k, &layers[l].v, &layers[l].o, &layers[l].gate,
                                 &layers[l].up, &layers[l].down, &layers[l].sgate, &layers[l].sup, &layers[l].sdown};
        for (int j = 0; j < 10; ++j) {
            const int64_t s = lin_scratch(ls[j], T, bf16);
            if (s > lin) lin = s;
        }
        if (layers[l].sdown.k > Iw) Iw = layers[l].sdown.k;
        if (layers[l].experts > X) X = layers[l].experts;   /* the widest router and top-k */
        if (layers[l].topk > K) K = layers[l].topk;
    }
    /* x: normed rows; qkv; attn; o: a projection's output; gu: gate|up; act: silu(g) * u; sq: each
     * thread's squares (a row's); lin: the GEMMs'; moe: the router's rows in fp32,
     * its logits, each row's weights and expert ids */
    if (lin < D) lin = D;   /* also an int8 row's room (lmi_kv_i8_roundtrip) */
    const int64_t sqn = E > H * D ? E : H * D;     /* a hidden row, a head or a whole q (QK_FULL) */
    const int64_t moe = X ? (T * (bf16 ? E : 0) + T * X + T * K + T) * 4 + T * K * 8 + T * E * es + 5 * 64 : 0;
    const int64_t sizes[] = {T * E * es, T * nqkv * es, T * H * D * es, T * E * es, T * 2 * Iw * es, T * Iw * es,
                             (int64_t)threads * sqn * 4, lin, moe};
    int64_t total = 0, off[9];
    for (int j = 0; j < 9; ++j) {
        off[j] = total;
        total += (sizes[j] + 63) / 64 * 64;
    }
    char *mem = aligned_alloc(64, (size_t)(total > 0 ? total : 64));
    if (!mem) return -2;
    void *x = mem + off[0], *qkv = mem + off[1], *attn = mem + off[2], *o = mem + off[3], *gu = mem + off[4];
    void *act = mem + off[5];
    float *sq = (float *)(mem + off[6]);
    char *ws = mem + off[7], *ms = mem + off[8];
    const int64_t np = T - B;
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; ++l) {
        const lmi_layer *ly = &layers[l];
        norm(h, ly->norm1, x, T, E, eps, lanes, sq, bf16, threads);
        char *q = qkv, *k = q + H * D * es, *v = q + (H + Hkv) * D * es;
        linear(&ly->q, x, T, q, nqkv, bf16, ws, threads);
        linear(&ly->k, x, T, q + ly->q.n * es, nqkv, bf16, ws, threads);
        linear(&ly->v, x, T, q + (ly->q.n + ly->k.n) * es, nqkv, bf16, ws, threads);
        if (ly->qk_norm) qk_norms(ly, qkv, T, H, Hkv, D, nqkv, eps, bf16, sq, sqn, threads);
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
            const lmi_kv_ctx pc = {ly->kc, ly->vc, ly->ksc, ly->vsc, ly->ksc ? KV_I8 : bf16, s_blk, s_tok, s_head, bs,
                                   ptw, ptables, pctx};
            rc = lmi_prefill_attention(q, k, v, nqkv, nqkv, nqkv, D, D, D, attn, H * D, D, bf16, pstarts, plens,
                                       porder, P, H, Hkv, D, scale, pctx ? &pc : NULL, threads);
        }
        if (rc) break;
        linear(&ly->o, attn, T, o, E, bf16, ws, threads);
        residual(h, o, T * E, bf16, threads);
        norm(h, ly->norm2, x, T, E, eps, lanes, sq, bf16, threads);
        if (ly->experts) {
            rc = moe_mlp(ly, x, T, E, bf16, o, ms, gu, act, ws, threads);
            if (rc) break;
            residual(h, o, T * E, bf16, threads);
            continue;
        }
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

/* ---------------------------------------------------------------- a mixture-of-experts MLP's experts */
/* One expert over its c gathered rows xs: y [c, E] = down(silu(gate(xs)) * up(xs)) (gu, act, ws: scratch
 * for c rows), the GEMMs on `gemm_threads` threads, SiLU split as torch splits it on `threads`. */
static void expert_rows(const lmi_lin *gate, const lmi_lin *up, const lmi_lin *down, const char *xs, int64_t c,
                        char *gu, char *act, char *y, char *ws, int64_t E, int bf16, int gemm_threads,
                        int threads) {
    const int64_t es = bf16 ? 2 : 4, ie = down->k;
    linear(gate, xs, c, gu, 2 * ie, bf16, ws, gemm_threads);
    linear(up, xs, c, gu + gate->n * es, 2 * ie, bf16, ws, gemm_threads);
    for (int64_t i = 0; i < c; ++i) memcpy(act + i * ie * es, gu + i * 2 * ie * es, (size_t)(ie * es));
    silu_mul_rows(act, gu + ie * es, c, ie, 2 * ie, bf16, threads);
    linear(down, act, c, y, E, bf16, ws, gemm_threads);
}

/* out rows r[0..c) += w[i] * y[i] (rows distinct): torch's h * w then index_put_(accumulate=True) */
static void add_weighted(void *out, const int64_t *r, const float *w, const char *y, int64_t c, int64_t E, int bf16,
                         int threads) {
#pragma omp parallel for num_threads(threads) if (c * E >= GRAIN) schedule(static)
    for (int64_t i = 0; i < c; ++i) {
        const float wt = w[i];
        if (bf16) {
            uint16_t *o = (uint16_t *)out + r[i] * E;
            const uint16_t *yy = (const uint16_t *)y + i * E;
            for (int64_t d = 0; d < E; ++d)
                o[d] = f32_to_bf16(bf16_to_f32(o[d]) + bf16_to_f32(f32_to_bf16(bf16_to_f32(yy[d]) * wt)));
        } else {
            float *o = (float *)out + r[i] * E;
            const float *yy = (const float *)y + i * E;
            for (int64_t d = 0; d < E; ++d) o[d] += yy[d] * wt;
        }
    }
}

/* The expert-parallel path's scratch bound: every pair's down row kept until the ordered sum. */
#define MOE_Y_BYTES (64 << 20)

/* out [T, E] = sum over each row t's k experts e = ids[t, j] of weights[t, j] * down_e(silu(gate_e(x_t)) *
 * up_e(x_t)), for a step's rows x [T, E] (prefill and decode rows together), fp32 or bf16 (`bf16`).
 * gate, up, down: X lmi_lin each, the experts' packed weights (any LIN_* kind, as `linear` takes them;
 * gate and up fused: gate[e] holds gate|up and up[e].n = 0). The (row, slot) pairs are grouped by expert
 * (a counting sort, slot-major within an expert, as handler/model/moe.py orders them), and each active
 * expert multiplies all its rows at once, by the same GEMMs and the same SiLU the dense MLP's layers
 * call: its weights are read once a step (once per 1 MiB chunk of rows, cpu_panel.h). Each down row,
 * as it comes out, is scaled by its routing weight and added into its output row in ascending expert
 * order: torch's `out.index_put_((rows,), down(h) * w, accumulate=True)` per expert (fp32: one
 * product, one sum; bf16: the product rounded, the sum rounded), the Python loop's values bit for bit.
 *
 * Two ways to spread the work, the same values (a row's GEMM outputs depend on that row only):
 *   experts in parallel (at least 2 active experts a thread, their down rows within MOE_Y_BYTES: decode
 *     steps and small batches): one parallel region, each thread taking whole experts (largest first),
 *     its GEMMs on itself, every down row kept; then the ordered sums. A decode step's experts are
 *     each a few rows: one region instead of two per expert (a region's start costs ~50 us where
 *     threads sleep between regions, OMP_WAIT_POLICY=passive);
 *   else one expert after another, each GEMM's panels over the threads, the sums as its rows come out.
 * `weights` fp32 [T, k] (bf16 weights widened: exact), ids int64 [T, k]. Returns 0, -1 (an id outside
 * [0, X): nothing written), -2 (no memory). */
int lmi_moe_experts(const lmi_lin *gate, const lmi_lin *up, const lmi_lin *down, int64_t X, const void *x,
                    int64_t T, int64_t E, int64_t k, const int64_t *ids, const float *weights, void *out, int bf16,
                    int threads) {
    const int64_t es = bf16 ? 2 : 4, pairs = T * k;
    int64_t *count = calloc((size_t)(2 * X + 2), sizeof(int64_t));
    if (!count) return -2;
    int64_t *order = count + X + 1;     /* the active experts, most rows first */
    for (int64_t p = 0; p < pairs; ++p) {
        if (ids[p] < 0 || ids[p] >= X) {
            free(count);
            return -1;
        }
        count[ids[p] + 1]++;
    }
    int64_t cmax = 0, I = 0, lin = 0, active = 0;
    for (int64_t e = 0; e < X; ++e) {
        const int64_t c = count[e + 1];
        count[e + 1] += count[e];       /* count[e]: the first pair of expert e */
        if (!c) continue;
        int64_t at = active++;          /* insertion by rows, descending (ties: ascending expert) */
        for (; at > 0 && count[order[at - 1] + 1] - count[order[at - 1]] < c; --at) order[at] = order[at - 1];
        order[at] = e;
        if (c > cmax) cmax = c;
        if (down[e].k > I) I = down[e].k;
        const lmi_lin *ls[3] = {&gate[e], &up[e], &down[e]};
        for (int j = 0; j < 3; ++j) {
            const int64_t sz = lin_scratch(ls[j], c, bf16);
            if (sz > lin) lin = sz;
        }
    }
    const int par = threads > 1 && active >= 2 * threads && pairs * E * es <= MOE_Y_BYTES;
    const int nt = par ? threads : 1;
    /* rows, w: the pairs by expert; ys: every pair's down row (par) or one expert's; per thread: xs (its
     * expert's rows gathered), gu (gate|up), act (silu(g) * u), ws (the GEMMs' scratch) */
    const int64_t per[] = {cmax * E * es, cmax * 2 * I * es, cmax * I * es, lin};
    int64_t stride = 0;
    for (int j = 0; j < 4; ++j) stride += (per[j] + 63) / 64 * 64;
    const int64_t head[] = {pairs * 8, pairs * 4, (par ? pairs : cmax) * E * es};
    int64_t total = nt * stride, off[3];
    for (int j = 0; j < 3; ++j) {
        off[j] = total;
        total += (head[j] + 63) / 64 * 64;
    }
    char *mem = aligned_alloc(64, (size_t)(total > 0 ? total : 64));
    if (!mem) {
        free(count);
        return -2;
    }
    int64_t *rows = (int64_t *)(mem + off[0]);
    float *w = (float *)(mem + off[1]);
    char *ys = mem + off[2];
    for (int64_t j = 0; j < k; ++j)     /* slot-major, then row: handler/model/moe.py's order */
        for (int64_t t = 0; t < T; ++t) {
            const int64_t at = count[ids[t * k + j]]++;
            rows[at] = t, w[at] = weights[t * k + j];
        }
    for (int64_t e = X; e > 0; --e) count[e] = count[e - 1];   /* back to each expert's first pair */
    count[0] = 0;
    memset(out, 0, (size_t)(T * E * es));
    if (par) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t a = 0; a < active; ++a) {
            const int64_t e = order[a], c = count[e + 1] - count[e], *r = rows + count[e];
            char *own = mem + (int64_t)omp_get_thread_num() * stride;
            char *xs = own, *gu = xs + (per[0] + 63) / 64 * 64, *act = gu + (per[1] + 63) / 64 * 64;
            char *ws = act + (per[2] + 63) / 64 * 64;
            for (int64_t i = 0; i < c; ++i) memcpy(xs + i * E * es, (const char *)x + r[i] * E * es, (size_t)(E * es));
            expert_rows(&gate[e], &up[e], &down[e], xs, c, gu, act, ys + count[e] * E * es, ws, E, bf16, 1, threads);
        }
        for (int64_t e = 0; e < X; ++e)     /* the sums, experts in ascending order */
            if (count[e + 1] > count[e])
                add_weighted(out, rows + count[e], w + count[e], ys + count[e] * E * es, count[e + 1] - count[e], E,
                             bf16, threads);
    } else {
        char *xs = mem, *gu = xs + (per[0] + 63) / 64 * 64, *act = gu + (per[1] + 63) / 64 * 64;
        char *ws = act + (per[2] + 63) / 64 * 64;
        for (int64_t e = 0; e < X; ++e) {
            const int64_t c = count[e + 1] - count[e], *r = rows + count[e];
            if (!c) continue;
#pragma omp parallel for num_threads(threads) if (c * E >= GRAIN) schedule(static)
            for (int64_t i = 0; i < c; ++i)
                memcpy(xs + i * E * es, (const char *)x + r[i] * E * es, (size_t)(E * es));
            expert_rows(&gate[e], &up[e], &down[e], xs, c, gu, act, ys, ws, E, bf16, threads, threads);
            add_weighted(out, r, w + count[e], ys, c, E, bf16, threads);
        }
    }
    free(mem);
    free(count);
    return 0;
}

/* ---------------------------------------------------------------- a mixture-of-experts MLP's routing */
/* Per row t of logits [T, X] (fp32, overwritten: the row's probabilities, the chosen ones -1): p =
 * softmax(logits[t]) in fp32 (the maximum subtracted, expf, the exponentials summed in expert order, each
 * divided by the sum), the k largest p (ties to the lower expert id) -> ids[t, 0..k) in descending order,
 * their p -> weights[t, ..]; `norm`: each divided by their sum (added in that order); `round_bf16`: rounded
 * to bf16 (families whose weights take the logits' dtype). What handler/model/moe.py's router computes,
 * softmax/top-k/renormalise as transformers' routers, and the same function on both its paths (Python
 * layer, C stack), so the two route alike bit for bit. */
void lmi_moe_route(float *logits, int64_t T, int64_t X, int64_t k, int norm, int round_bf16, float *weights,
                   int64_t *ids) {
    for (int64_t t = 0; t < T; ++t) {
        float *p = logits + t * X, m = p[0], sum = 0.f;
        for (int64_t e = 1; e < X; ++e) m = p[e] > m ? p[e] : m;
        for (int64_t e = 0; e < X; ++e) sum += p[e] = expf(p[e] - m);
        for (int64_t e = 0; e < X; ++e) p[e] = p[e] / sum;
        float *w = weights + t * k, tot = 0.f;
        int64_t *id = ids + t * k;
        for (int64_t j = 0; j < k; ++j) {    /* selection: the next largest, the lower id on ties (-1: taken) */
            int64_t best = -1;
            for (int64_t e = 0; e < X; ++e)
                if (p[e] != -1.f && (best < 0 || p[e] > p[best])) best = e;
            id[j] = best, w[j] = p[best], p[best] = -1.f;
            tot += w[j];
        }
        for (int64_t j = 0; j < k; ++j) {
            if (norm) w[j] = w[j] / tot;
            if (round_bf16) w[j] = bf16_to_f32(f32_to_bf16(w[j]));
        }
    }
}

/* out [T, E] += sigmoid(g[t]) * s[t]: Qwen2-MoE's shared expert s [T, E] (activations' dtype) gated by its
 * gate's fp32 logit g [T]; the sigmoid 1 / (1 + expf(-g)) in fp32; bf16: the sigmoid, the product and the sum
 * each rounded to bf16 (as torch's `out + torch.sigmoid(gate) * s` rounds in bf16). handler/model/moe.py's bound
 * layer and the C stack both add it here. */
void lmi_moe_shared(void *out, const void *s, const float *g, int64_t T, int64_t E, int bf16) {
    for (int64_t t = 0; t < T; ++t) {
        const float sg = 1.0f / (1.0f + expf(-g[t]));
        if (bf16) {
            const float sb = bf16_to_f32(f32_to_bf16(sg));
            uint16_t *o = (uint16_t *)out + t * E;
            const uint16_t *ss = (const uint16_t *)s + t * E;
            for (int64_t i = 0; i < E; ++i)
                o[i] = f32_to_bf16(bf16_to_f32(o[i]) + bf16_to_f32(f32_to_bf16(sb * bf16_to_f32(ss[i]))));
        } else {
            float *o = (float *)out + t * E;
            const float *ss = (const float *)s + t * E;
            for (int64_t i = 0; i < E; ++i) o[i] = o[i] + sg * ss[i];
        }
    }
}

/* A sparse layer's MLP in the stack: out [T, E] = the experts' weighted sum for the normed rows x
 * (handler/model/moe.py SparseMoe): the router's logits by the fp32 panel GEMM (bf16 rows widened, exact),
 * lmi_moe_route, lmi_moe_experts; with a shared expert, its MLP over every row (gu, act, ws: the stack's
 * scratch) and lmi_moe_shared. ms: the stack's moe scratch. */
static int moe_mlp(const lmi_layer *ly, const void *x, int64_t T, int64_t E, int bf16, void *out, char *ms,
                   void *gu, void *act, char *ws, int threads) {
    const int64_t X = ly->experts, k = ly->topk, es = bf16 ? 2 : 4;
    float *xf = (float *)x;
    if (bf16) {
        xf = (float *)ms;
        widen(x, xf, T * E);
        ms += (T * E * 4 + 63) / 64 * 64;
    }
    float *logits = (float *)ms, *w = logits + T * X;
    ms += ((T * X + T * k) * 4 + 63) / 64 * 64;
    int64_t *ids = (int64_t *)ms;
    ms += (T * k * 8 + 63) / 64 * 64;
    lmi_gemm(xf, T, E, E, ly->router, X, 0, logits, X, threads);
    lmi_moe_route(logits, T, X, k, (int)ly->route_norm, (int)ly->route_bf16, w, ids);
    const int rc = lmi_moe_experts(ly->xgate, ly->xup, ly->xdown, X, x, T, E, k, ids, w, out, bf16, threads);
    if (rc || !ly->sdown.n) return rc;
    char *s = ms;
    float *g = (float *)(ms + (T * E * es + 63) / 64 * 64);
    expert_rows(&ly->sgate, &ly->sup, &ly->sdown, x, T, gu, act, s, ws, E, bf16, threads, threads);
    lmi_gemm(xf, T, E, E, ly->shared_gate, 1, 0, g, 1, threads);
    lmi_moe_shared(out, s, g, T, E, bf16);
    return 0;
}
