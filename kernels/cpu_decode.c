/* Decode attention on CPU reading the paged KV pool in place (kernels/cpu/ builds and
 * loads it; kernels/reference.py is its oracle and the fallback).
 *
 * One query row per sequence (decode). Work item = (sequence b, KV head kh): the g query heads
 * that share kh are scored against every visible key of the sequence's blocks, read where they
 * lie in the pool (no gather copy), then softmax and the weighted sum of the values, all in fp32.
 * Items run in parallel on the process's OpenMP pool (the same libgomp torch loaded).
 *
 * Pool: [NB, bs, Hkv, D] addressed through element strides (block, token, head) with D
 * contiguous, so both the head-major CPU allocation and the token-major one are read as is.
 * K/V elements are fp32 (kv_bf16 = 0), bf16 (kv_bf16 = 1) or int8 (KV_I8, the _i8 entry points): an
 * int8 pool has one fp32 scale per (token, head) row beside it, ksc / vsc, at the row's element
 * offset / D (the pool's layout with D collapsed), row = q8 * scale (kernels/cpu_layer.c writes
 * them); its rows are read as int8 and widened in registers, never copied out dequantized.
 * q, out: fp32 [B, H, D] contiguous; tables: int32 [B, tw]; lens: int32 [B] (context length,
 * this step's token included). window > 0: a query at position i sees keys j > i - window;
 * softcap > 0: logits become tanh(s / softcap) * softcap.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_bf16.h"

#ifndef PF
#define PF 16   /* prefetch distance in keys */
#endif

/* Row r of the pool as fp32 in dst[0:D]. */
static inline void load_row(float *restrict dst, const void *base, int64_t off, int64_t D, int kv_bf16) {
    if (kv_bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    }
}

/* The row at element offset off as fp32: in place for an fp32 pool, else converted into buf. */
static inline const float *row_at(const void *pool, int64_t off, int64_t D, int kv_bf16, float *buf) {
    if (!kv_bf16) return (const float *)pool + off;
    load_row(buf, pool, off, D, 1);
    return buf;
}

/* Ask for `bytes` from the row at element offset off (memory-level parallelism over scattered
 * blocks). */
static inline void prefetch_row(const void *pool, int64_t esz, int64_t off, int64_t bytes) {
    const char *p = (const char *)pool + off * esz;
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c);
}

/* out_j[0:D] = sum_t p[j, t] v_t for the g heads, one head at a time so its accumulator stays in
 * registers (DC a constant: 64 and 128 get their own copies, with the loops unrolled). v_t: row
 * t of vb (fp32 copies, [L - t0, DC]) when given, else the fp32 pool's row at offs[t]. */
#define LMI_PV(NAME, DC)                                                                          \
    static void NAME(const float *s, int64_t maxlen, const float *vb, const float *vc,            \
                     const int64_t *offs, int64_t t0, int64_t L, int64_t g, int64_t D, float *ob) { \
        for (int64_t j = 0; j < g; ++j) {                                                          \
            float a[DC];                                                                           \
            for (int64_t d = 0; d < (DC); ++d) a[d] = 0.f;                                         \
            const float *pj = s + j * maxlen;                                                      \
            for (int64_t t = t0; t < L; ++t) {                                                     \
                if (!vb && j == 0 && t + PF < L)                                                   \
                    prefetch_row(vc, 4, offs[t + PF], (DC) * 4);                                   \
                const float *v = vb ? vb + (t - t0) * (DC) : vc + offs[t];                         \
                const float pt = pj[t];                                                            \
                _Pragma("omp simd") for (int64_t d = 0; d < (DC); ++d) a[d] += pt * v[d];          \
            }                                                                                      \
            memcpy(ob + j * (DC), a, sizeof(float) * (size_t)(DC));                                \
        }                                                                                          \
    }
LMI_PV(pv_64, 64)
LMI_PV(pv_128, 128)
LMI_PV(pv_any, D)   /* any other head size (a variable-length accumulator) */
#undef LMI_PV

/* An int8 pool's out_j[0:D] = sum_t (p[j, t] * vs[t]) v8_t: the row's scale folded into its
 * weight, the int8 row widened in registers. */
#define LMI_PV8(NAME, DC)                                                                         \
    static void NAME(const float *s, int64_t maxlen, const int8_t *vc, const float *vs,           \
                     const int64_t *offs, int64_t t0, int64_t L, int64_t g, int64_t D, float *ob) { \
        for (int64_t j = 0; j < g; ++j) {                                                          \
            float a[DC];                                                                           \
            for (int64_t d = 0; d < (DC); ++d) a[d] = 0.f;                                         \
            const float *pj = s + j * maxlen;                                                      \
            for (int64_t t = t0; t < L; ++t) {                                                     \
                if (j == 0 && t + PF < L) prefetch_row(vc, 1, offs[t + PF], (DC));                 \
                const int8_t *v = vc + offs[t];                                                    \
                const float pt = pj[t] * vs[t];                                                    \
                _Pragma("omp simd") for (int64_t d = 0; d < (DC); ++d) a[d] += pt * (float)v[d];   \
            }                                                                                      \
            memcpy(ob + j * (DC), a, sizeof(float) * (size_t)(DC));                                \
        }                                                                                          \
    }
LMI_PV8(pv8_64, 64)
LMI_PV8(pv8_128, 128)
LMI_PV8(pv8_any, D)
#undef LMI_PV8

/* One (sequence, KV head) item over int8 pools: scores s[j, t] = (q_j . k8_t) * ks[t] * scale,
 * four keys at a time, into s[:, t0:L]; ks/vs[t0:L]: the rows' scales gathered once. */
static void scores_i8(const float *qb, const int8_t *kc, const float *ks, const int64_t *offs, int64_t t0,
                      int64_t L, int64_t g, int64_t D, float scale, float *s, int64_t maxlen) {
    int64_t t = t0;
    for (; t + 4 <= L; t += 4) {
        const int8_t *k0 = kc + offs[t], *k1 = kc + offs[t + 1], *k2 = kc + offs[t + 2], *k3 = kc + offs[t + 3];
        for (int u = 0; u < 4 && t + PF + u < L; ++u) prefetch_row(kc, 1, offs[t + PF + u], D);
        for (int64_t j = 0; j < g; ++j) {
            const float *qj = qb + j * D;
            float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t d = 0; d < D; ++d) {
                const float qd = qj[d];
                d0 += qd * (float)k0[d];
                d1 += qd * (float)k1[d];
                d2 += qd * (float)k2[d];
                d3 += qd * (float)k3[d];
            }
            float *sj = s + j * maxlen + t;
            sj[0] = d0 * (ks[t] * scale);
            sj[1] = d1 * (ks[t + 1] * scale);
            sj[2] = d2 * (ks[t + 2] * scale);
            sj[3] = d3 * (ks[t + 3] * scale);
        }
    }
    for (; t < L; ++t) {
        const int8_t *k = kc + offs[t];
        for (int64_t j = 0; j < g; ++j) {
            const float *qj = qb + j * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qj[d] * (float)k[d];
            s[j * maxlen + t] = dot * (ks[t] * scale);
        }
    }
}

/* Softmax over t in [t0, L) of each of the g score rows s[j, :] (row stride maxlen), in place;
 * softcap > 0 first maps each logit to tanh(s / softcap) * softcap. */
static void softmax_rows(float *s, int64_t maxlen, int64_t g, int64_t t0, int64_t L, float softcap) {
    for (int64_t j = 0; j < g; ++j) {
        float *sj = s + j * maxlen;
        if (softcap > 0.f) {
#pragma omp simd
            for (int64_t t = t0; t < L; ++t) sj[t] = tanhf(sj[t] / softcap) * softcap;
        }
        float m = sj[t0];
#pragma omp simd reduction(max : m)
        for (int64_t t = t0 + 1; t < L; ++t) m = sj[t] > m ? sj[t] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = t0; t < L; ++t) {
            sj[t] = expf(sj[t] - m);
            sum += sj[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = t0; t < L; ++t) sj[t] *= inv;
    }
}

/* q: row b at q + b * q_tok (its H heads contiguous); kv_bf16: 0 fp32, 1 bf16, KV_I8 int8 (with
 * ksc / vsc); the rest as lmi_decode_attention. */
static int decode_attention(const float *q, int64_t q_tok, const void *kc, const void *vc, int kv_bf16,
                            const float *ksc, const float *vsc, int64_t s_blk, int64_t s_tok, int64_t s_head,
                            const int32_t *tables, int64_t tw, const int32_t *lens,
                            int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                            float scale, int64_t window, float softcap, float *out, int nthreads) {
    const int64_t g = H / Hkv;
    const int i8 = kv_bf16 == KV_I8;
    if (i8) kv_bf16 = 0;
    const int64_t esz = kv_bf16 ? 2 : 4;
    int64_t maxlen = 0;
    for (int64_t b = 0; b < B; ++b) maxlen = lens[b] > maxlen ? lens[b] : maxlen;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* Per thread: scores [g, maxlen], four fp32 K rows, a bf16 pool's V rows as fp32
         * [maxlen, D], and each key row's element offset (the blocks walked once per item, no
         * division per key). */
        float *s = malloc(sizeof(float) * (size_t)(g * maxlen + 4 * D + 1 + (kv_bf16 ? maxlen * D : 0)
                                                   + (i8 ? 2 * maxlen : 0)));
        int64_t *offs = malloc(sizeof(int64_t) * (size_t)(maxlen + 1));
        if (!s || !offs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *row = s + g * maxlen, *vbuf = row + 4 * D;
            float *ks = vbuf, *vs = vbuf + maxlen;     /* int8: each visible row's K and V scales */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < B * Hkv; ++item) {
                const int64_t b = item / Hkv, kh = item % Hkv;
                const int64_t L = lens[b];
                const int64_t t0 = (window > 0 && L - window > 0) ? L - window : 0;
                const int32_t *tbl = tables + b * tw;
                const float *qb = q + b * q_tok + kh * g * D;
                float *ob = out + (b * H + kh * g) * D;
                if (L <= 0) {
                    memset(ob, 0, sizeof(float) * (size_t)(g * D));
                    continue;
                }
                for (int64_t blk = t0 / bs, t = blk * bs; t < L; ++blk) {
                    const int64_t base = (int64_t)tbl[blk] * s_blk + kh * s_head;
                    for (int64_t o = 0; o < bs && t < L; ++o, ++t) offs[t] = base + o * s_tok;
                }
                if (i8) {
                    for (int64_t t = t0; t < L; ++t) {
                        ks[t] = ksc[offs[t] / D];
                        vs[t] = vsc[offs[t] / D];
                    }
                    scores_i8(qb, (const int8_t *)kc, ks, offs, t0, L, g, D, scale, s, maxlen);
                    softmax_rows(s, maxlen, g, t0, L, softcap);
                    if (D == 64)
                        pv8_64(s, maxlen, (const int8_t *)vc, vs, offs, t0, L, g, D, ob);
                    else if (D == 128)
                        pv8_128(s, maxlen, (const int8_t *)vc, vs, offs, t0, L, g, D, ob);
                    else
                        pv8_any(s, maxlen, (const int8_t *)vc, vs, offs, t0, L, g, D, ob);
                    continue;
                }
                /* scores s[j, t] = q_j . k_t * scale, four keys at a time (four independent
                 * accumulators per head keep the FMA units busy across the reductions) */
                int64_t t = t0;
                for (; t + 4 <= L; t += 4) {
                    const float *k4[4];
                    for (int u = 0; u < 4; ++u)
                        k4[u] = row_at(kc, offs[t + u], D, kv_bf16, row + u * D);
                    for (int u = 0; u < 4 && t + PF + u < L; ++u)   /* the next keys' lines, PF ahead */
                        prefetch_row(kc, esz, offs[t + PF + u], D * esz);
                    const float *k0 = k4[0], *k1 = k4[1], *k2 = k4[2], *k3 = k4[3];
                    for (int64_t j = 0; j < g; ++j) {
                        const float *qj = qb + j * D;
                        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                        for (int64_t d = 0; d < D; ++d) {
                            const float qd = qj[d];
                            d0 += qd * k0[d];
                            d1 += qd * k1[d];
                            d2 += qd * k2[d];
                            d3 += qd * k3[d];
                        }
                        float *sj = s + j * maxlen + t;
                        sj[0] = d0 * scale;
                        sj[1] = d1 * scale;
                        sj[2] = d2 * scale;
                        sj[3] = d3 * scale;
                    }
                }
                for (; t < L; ++t) {
                    const float *k = row_at(kc, offs[t], D, kv_bf16, row);
                    for (int64_t j = 0; j < g; ++j) {
                        const float *qj = qb + j * D;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < D; ++d) dot += qj[d] * k[d];
                        s[j * maxlen + t] = dot * scale;
                    }
                }
                softmax_rows(s, maxlen, g, t0, L, softcap);
                /* out_j = sum_t p[j, t] v_t; a bf16 pool's rows converted once for the g heads */
                const float *vb = NULL;
                if (kv_bf16) {
                    for (int64_t t = t0; t < L; ++t) {
                        if (t + PF < L)
                            prefetch_row(vc, esz, offs[t + PF], D * esz);
                        load_row(vbuf + (t - t0) * D, vc, offs[t], D, 1);
                    }
                    vb = vbuf;
                }
                if (D == 64)
                    pv_64(s, maxlen, vb, (const float *)vc, offs, t0, L, g, D, ob);
                else if (D == 128)
                    pv_128(s, maxlen, vb, (const float *)vc, offs, t0, L, g, D, ob);
                else
                    pv_any(s, maxlen, vb, (const float *)vc, offs, t0, L, g, D, ob);
            }
        }
        free(s);
        free(offs);
    }
    return failed ? -1 : 0;
}

int lmi_decode_attention(const float *q, const void *kc, const void *vc, int kv_bf16,
                         int64_t s_blk, int64_t s_tok, int64_t s_head,
                         const int32_t *tables, int64_t tw, const int32_t *lens,
                         int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                         float scale, int64_t window, float softcap, float *out, int nthreads) {
    return decode_attention(q, H * D, kc, vc, kv_bf16, NULL, NULL, s_blk, s_tok, s_head, tables, tw, lens, B, H,
                            Hkv, D, bs, scale, window, softcap, out, nthreads);
}

/* lmi_decode_attention over int8 pools kc / vc with their row scales ksc / vsc (see the top). */
int lmi_decode_attention_i8(const float *q, const int8_t *kc, const int8_t *vc, const float *ksc, const float *vsc,
                            int64_t s_blk, int64_t s_tok, int64_t s_head,
                            const int32_t *tables, int64_t tw, const int32_t *lens,
                            int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                            float scale, int64_t window, float softcap, float *out, int nthreads) {
    return decode_attention(q, H * D, kc, vc, KV_I8, ksc, vsc, s_blk, s_tok, s_head, tables, tw, lens, B, H, Hkv,
                            D, bs, scale, window, softcap, out, nthreads);
}

/* 1 when every slot is below nslots (negative ones are skipped by the writers) */
static int slots_fit(const int64_t *slots, int64_t T, int64_t nslots) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= nslots) return 0;
    return 1;
}

/* Store key/value rows [T, Hkv, D] (element strides: token, head; D contiguous) at flat slots
 * slots[T] of the pools (slot = block * bs + offset; a negative slot is skipped; -1 returned,
 * nothing written, when a slot is >= nslots). elem: bytes
 * per element (the pools' dtype, which the rows already have). */
int lmi_write_kv(void *kc, void *vc, const void *key, const void *value, int64_t elem,
                 int64_t s_blk, int64_t s_tok, int64_t s_head,
                 int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head,
                 const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t bs, int64_t nslots) {
    const size_t row = (size_t)(D * elem);
    if (!slots_fit(slots, T, nslots)) return -1;   /* nothing is written unless every slot is in the pool */
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t base = (slot / bs) * s_blk + (slot % bs) * s_tok;
        for (int64_t h = 0; h < Hkv; ++h) {
            memcpy((char *)kc + (base + h * s_head) * elem, (const char *)key + (t * k_tok + h * k_head) * elem, row);
            memcpy((char *)vc + (base + h * s_head) * elem, (const char *)value + (t * v_tok + h * v_head) * elem, row);
        }
    }
    return 0;
}

/* A decode step's attention for one layer in one call (every sequence one row): the rotary
 * embedding of q [B, H, D] and k [B, Hkv, D] in place (lmi_rotary: transformers' rounding), k and
 * v [B, Hkv, D] stored at slots [B] of the pools (lmi_write_kv; a negative slot is skipped), then
 * decode attention over the pools into out [B, H, D]. q/k/v: row b at + b * qs / ks / vs
 * elements, heads contiguous (views of one fused q/k/v product); activations, pools and out all
 * fp32 (bf16 = 0) or all bf16 (q widened exactly, out rounded to nearest even as torch's
 * .to(bfloat16)). cos/sin [B, D] rows cs apart. Returns 0; -1 (nothing changed) when a slot is
 * past the pool; -2 when scratch could not be allocated. */
/* lmi_decode_fused's body; ksc / vsc non-NULL: int8 pools with their row scales. */
static int decode_fused(void *q, void *k, void *v, int64_t qs, int64_t ks, int64_t vs, const void *cos,
                        const void *sin, int64_t cs, int bf16, void *kc, void *vc, float *ksc, float *vsc,
                        int64_t s_blk, int64_t s_tok, int64_t s_head, const int64_t *slots, int64_t nslots,
                        const int32_t *tables, int64_t tw, const int32_t *lens, int64_t B, int64_t H, int64_t Hkv,
                        int64_t D, int64_t bs, float scale, int64_t window, float softcap, void *out, int nthreads) {
    if (!slots_fit(slots, B, nslots)) return -1;   /* checked before q/k are rotated in place */
    lmi_rotary(q, k, cos, sin, B, H, Hkv, D, qs, ks, cs, bf16, nthreads);
    const int i8 = ksc != NULL;
    if (i8)
        lmi_write_kv_i8(kc, vc, ksc, vsc, k, v, bf16, s_blk, s_tok, s_head, ks, D, vs, D, slots, B, Hkv, D, bs,
                        nslots);
    else
        lmi_write_kv(kc, vc, k, v, bf16 ? 2 : 4, s_blk, s_tok, s_head, ks, D, vs, D, slots, B, Hkv, D, bs, nslots);
    const int kind = i8 ? KV_I8 : bf16;
    if (!bf16)
        return decode_attention((const float *)q, qs, kc, vc, kind, ksc, vsc, s_blk, s_tok, s_head, tables, tw, lens,
                                B, H, Hkv, D, bs, scale, window, softcap, (float *)out, nthreads) ? -2 : 0;
    float *qf = malloc(sizeof(float) * (size_t)(2 * B * H * D));
    if (!qf) return -2;
    float *of = qf + B * H * D;
    for (int64_t b = 0; b < B; ++b) {
        const uint16_t *src = (const uint16_t *)q + b * qs;
#pragma omp simd
        for (int64_t i = 0; i < H * D; ++i) qf[b * H * D + i] = bf16_to_f32(src[i]);
    }
    const int rc = decode_attention(qf, H * D, kc, vc, kind, ksc, vsc, s_blk, s_tok, s_head, tables, tw, lens, B, H,
                                    Hkv, D, bs, scale, window, softcap, of, nthreads);
    uint16_t *o = (uint16_t *)out;
    for (int64_t i = 0; i < B * H * D; ++i) o[i] = f32_to_bf16(of[i]);
    free(qf);
    return rc ? -2 : 0;
}

int lmi_decode_fused(void *q, void *k, void *v, int64_t qs, int64_t ks, int64_t vs,
                     const void *cos, const void *sin, int64_t cs, int bf16,
                     void *kc, void *vc, int64_t s_blk, int64_t s_tok, int64_t s_head,
                     const int64_t *slots, int64_t nslots, const int32_t *tables, int64_t tw, const int32_t *lens,
                     int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                     float scale, int64_t window, float softcap, void *out, int nthreads) {
    return decode_fused(q, k, v, qs, ks, vs, cos, sin, cs, bf16, kc, vc, NULL, NULL, s_blk, s_tok, s_head, slots,
                        nslots, tables, tw, lens, B, H, Hkv, D, bs, scale, window, softcap, out, nthreads);
}

/* lmi_decode_fused over int8 pools (activations fp32 or bf16, as bf16 says): k and v quantized
 * per (token, head) row as lmi_write_kv_i8 stores them, attention reading the int8 rows and their
 * scales ksc / vsc. */
int lmi_decode_fused_i8(void *q, void *k, void *v, int64_t qs, int64_t ks, int64_t vs,
                        const void *cos, const void *sin, int64_t cs, int bf16,
                        int8_t *kc, int8_t *vc, float *ksc, float *vsc, int64_t s_blk, int64_t s_tok, int64_t s_head,
                        const int64_t *slots, int64_t nslots, const int32_t *tables, int64_t tw, const int32_t *lens,
                        int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                        float scale, int64_t window, float softcap, void *out, int nthreads) {
    return decode_fused(q, k, v, qs, ks, vs, cos, sin, cs, bf16, kc, vc, ksc, vsc, s_blk, s_tok, s_head, slots,
                        nslots, tables, tw, lens, B, H, Hkv, D, bs, scale, window, softcap, out, nthreads);
}

/* Llama's RMSNorm of bf16 rows x [rows, H] (contiguous) with weight w [H]:
 * out = w * bf16(x * rsqrt(mean(x^2) + eps)), the mean in fp32, each product rounded to bf16
 * as transformers' two bf16 steps round it. */
void lmi_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t H,
                       float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * H >= 32768) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *xr = x + r * H;
        uint16_t *o = out + r * H;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; ++i) {
            const float v = bf16_to_f32(xr[i]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
            const float y = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv));
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * y);
        }
    }
}

/* Per row r of fp32 logits x [rows, V] (row stride ld): the first index of the row's maximum
 * (torch.argmax's choice), the maximum m and log(sum_v exp(x_v - m)), so that a token's log-prob
 * is (x_t - m) - logsum, log_softmax's own formula. One read of each row (it stays in L2), rows in
 * parallel. The sum's error does not grow with the vocabulary nor depend on the vector width: fp32
 * lanes over blocks of RS_BLOCK values, the blocks added in fp64 (one fp32 sum per lane over a
 * 49k vocabulary drifted by ~1e-4 with 8 lanes). Built with -ffast-math: a NaN or infinite logit makes that row's logsum NaN or
 * infinite (exp(NaN) and inf - inf propagate), which the caller detects and hands back to torch. */
#define RS_BLOCK 256

void lmi_row_stats(const float *x, int64_t rows, int64_t V, int64_t ld, int64_t *argmax, float *maxv,
                   float *logsum, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * V >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * ld;
        float m = xr[0];
#pragma omp simd reduction(max : m)
        for (int64_t v = 1; v < V; ++v) m = xr[v] > m ? xr[v] : m;
        int64_t at = 0;
        while (at < V - 1 && !(xr[at] == m)) ++at;
        double sum = 0.0;   /* blocks of RS_BLOCK summed in fp32 vectors, the blocks' sums in fp64 */
        for (int64_t v0 = 0; v0 < V; v0 += RS_BLOCK) {
            const int64_t v1 = v0 + RS_BLOCK < V ? v0 + RS_BLOCK : V;
            float part = 0.f;
#pragma omp simd reduction(+ : part)
            for (int64_t v = v0; v < v1; ++v) part += expf(xr[v] - m);
            sum += part;
        }
        argmax[r] = at;
        maxv[r] = m;
        logsum[r] = (float)log(sum);
    }
}

/* ---------------------------------------------------------------- prompt attention */

#define PQ 64   /* query positions per chunk: a chunk scores only the keys up to its last position */

/* s[0:L] <- softmax(s[0:L] * scale) (scale > 0) over whole 16-float vectors (Lp a multiple of 16
 * within the row's room: no scalar tail of exp on rows of a few keys); s[L:Lp] is left tiny, the
 * caller zeroes what it reads. Exponents are clamped at -80 (e^-80 ~ 2e-35, nothing beside the
 * row's maximum's 1): libmvec's expf takes a scalar path for every lane that underflows. */
static void row_softmax(float *s, int64_t L, int64_t Lp, float scale) {
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
    for (int64_t t = L; t < Lp; ++t) s[t] = m - 1e30f;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < Lp; ++t) {
        const float x = (s[t] - m) * scale;
        s[t] = expf(x > -80.f ? x : -80.f);
        sum += t < L ? s[t] : 0.f;
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < Lp; ++t) s[t] *= inv;
}

/* A thread's scratch inside an OpenMP region: malloc'd; *failed raised (atomically) when it is not (the
 * caller's barrier then lets every thread see it). */
static void *scratch(size_t bytes, int *failed) {
    void *p = malloc(bytes);
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

/* The longest of P lengths (0 for none). */
static int64_t longest(const int64_t *lens, int64_t P) {
    int64_t n = 0;
    for (int64_t p = 0; p < P; ++p) n = lens[p] > n ? lens[p] : n;
    return n;
}

/* Row t (< pc->ctx[p]) of prompt p's KV head kh from pool `pool` (int8: its row scales `sc`) into dst[0:D] in
 * the activations' dtype (bf16 or fp32): lmi_kv_ctx's reading. */
static void ctx_row(void *dst, const lmi_kv_ctx *pc, const void *pool, const float *sc, int64_t p, int64_t t,
                    int64_t kh, int64_t D, int bf16) {
    const int64_t off = (int64_t)pc->tables[p * pc->tw + t / pc->bs] * pc->s_blk + (t % pc->bs) * pc->s_tok
                        + kh * pc->s_head;
    if (pc->kv == KV_I8) {
        const int8_t *r = (const int8_t *)pool + off;
        const float s = sc[off / D];
        for (int64_t d = 0; d < D; ++d) {
            const float x = (float)r[d] * s;
            if (bf16)
                ((uint16_t *)dst)[d] = f32_to_bf16(x);
            else
                ((float *)dst)[d] = x;
        }
    } else {
        memcpy(dst, (const char *)pool + off * (bf16 ? 2 : 4), (size_t)(D * (bf16 ? 2 : 4)));
    }
}

/* Row t of K [nk, D] (fp32 or bf16) into lmi_pack_b's / lmi_pack_bf16's panels of K: K's rows are the
 * panels' columns (row t is column t % 32 of panel t / 32; bf16 keeps K's d pairs together). */
static void put_k_row(void *kp, const void *row, int64_t t, int64_t D, int bf16) {
    const int64_t p = t / 32, j = t % 32;
    if (bf16) {     /* D is even (the caller's contract): pair q of the row is column j of pair-row q */
        const uint16_t *r = (const uint16_t *)row;
        uint16_t *dst = (uint16_t *)kp + (p * (D / 2) * 32 + j) * 2;
        for (int64_t q = 0; q < D / 2; ++q) {
            dst[q * 64] = r[2 * q];
            dst[q * 64 + 1] = r[2 * q + 1];
        }
    } else {
        const float *r = (const float *)row;
        float *dst = (float *)kp + p * D * 32 + j;
        for (int64_t d = 0; d < D; ++d) dst[d * 32] = r[d];
    }
}

/* The columns past nk in K's last panel: zero (as the packers pad). */
static void pad_k_rows(void *kp, int64_t nk, int64_t D, int bf16) {
    for (int64_t t = nk; t % 32; ++t) {
        const int64_t p = t / 32, j = t % 32;
        for (int64_t d = 0; d < D; ++d) {
            if (bf16)       /* element d of the row: pair-row d / 2, slot d % 2 */
                ((uint16_t *)kp)[((p * (D / 2) + d / 2) * 32 + j) * 2 + d % 2] = 0;
            else
                ((float *)kp)[(p * D + d) * 32 + j] = 0.f;
        }
    }
}

/* Row t of V [nk, D] into the panels lmi_pack_b / lmi_pack_bf16 make of V^T [D, nk]: panel p holds V's
 * columns p * 32 .. p * 32 + 31 (zero past D), fp32 one row after another ([nk][32]), bf16 two rows
 * interleaved ([kq][32][2], t's slot t % 2). */
static void put_v_row(void *vp, const void *row, int64_t t, int64_t nk, int64_t D, int bf16) {
    const int64_t kq = (nk + 1) / 2;
    for (int64_t c = 0; c < D; c += 32) {
        const int64_t nc = D - c < 32 ? D - c : 32, p = c / 32;
        if (bf16) {
            const uint16_t *r = (const uint16_t *)row + c;
            uint16_t *dst = (uint16_t *)vp + (p * kq + t / 2) * 64 + t % 2;
            for (int64_t j = 0; j < 32; ++j) dst[2 * j] = j < nc ? r[j] : 0;
        } else {
            float *dst = (float *)vp + (p * nk + t) * 32;
            memcpy(dst, (const float *)row + c, (size_t)nc * 4);
            for (int64_t j = nc; j < 32; ++j) dst[j] = 0.f;
        }
    }
}

/* Attention of P whole prompts (each one's context is its own rows of this step) by the panel
 * GEMMs, causal (a decoder's prompts: lmi_prefill_attention) or bidirectional (an encoder's long
 * sequences, every row seeing all its sequence's rows: lmi_encoder_attention): per (prompt, KV head)
 * item, K packed as a weight (S = Q K^T, the g query heads'
 * rows stacked), a causal softmax per row, V^T packed (O = P V, one call per 32-column panel so
 * that a chunk reads only its first keys). Items run on the OpenMP pool, largest first (`order`),
 * each GEMM on its own thread. q/k/v/out: row t's head at x + t * stride + head * head stride (qh
 * for q, khs for k, vhs for v, oh for out), D contiguous; fp32 (bf16 = 0) or bf16 throughout
 * (bf16 = 1: Q K^T by vdpbf16ps, scores and softmax in fp32, P V with P kept in fp32 and V widened
 * in registers, O rounded to bf16 once). starts/lens [P]: each prompt's first row and length.
 * pc (causal only; NULL: none): a prompt chunk's ctx earlier keys come from the pools (lmi_kv_ctx), its
 * keys are then positions 0 .. ctx + n - 1 (the pool's, then its own rows) and its row i sees 0 .. ctx + i.
 * Returns 0, or -2 when scratch memory ran out. */
static int prompt_attention(const void *q, const void *k, const void *v, int64_t qs, int64_t ks, int64_t vs,
                            int64_t qh, int64_t khs, int64_t vhs, void *out, int64_t os, int64_t oh, int bf16,
                            const int64_t *starts, const int64_t *lens, const int64_t *order, int64_t P, int64_t H,
                            int64_t Hkv, int64_t D, float scale, int causal, const lmi_kv_ctx *pc,
                            int nthreads) {
    const int64_t g = H / Hkv, es = bf16 ? 2 : 4;
    int64_t nmax = 0;   /* the most keys an item reads */
    for (int64_t p = 0; p < P; ++p) {
        const int64_t nk = lens[p] + (pc ? pc->ctx[p] : 0);
        nmax = nk > nmax ? nk : nmax;
    }
    const int64_t npad = (nmax + 31) / 32 * 32 + 2, dpad = (D + 31) / 32 * 32;
    const int64_t rows = g * PQ;
    /* per thread: A [rows, D]; K panels; V panels; S (then P) [rows, npad] fp32; O [rows, dpad] fp32 */
    const size_t per = (size_t)(rows * D * es + npad * (D + 2) * es + dpad * (npad + 2) * es
                                + rows * npad * 4 + rows * dpad * 4 + 64 * 8);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        char *mem = scratch(per, &failed);
#pragma omp barrier
        if (!failed) {
            char *a_buf = mem, *kp = a_buf + rows * D * es;
            char *vp = kp + npad * (D + 2) * es;
            float *s = (float *)(vp + dpad * (npad + 2) * es);
            float *o = s + rows * npad;
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < P * Hkv; ++item) {
                const int64_t pi = order[item / Hkv], kh = item % Hkv;
                const int64_t n = lens[pi], t0 = starts[pi];
                const int64_t c0 = pc ? pc->ctx[pi] : 0, nk = c0 + n;     /* keys: c0 in the pools, then n */
                const int64_t kq = (nk + 1) / 2;
                /* K [nk, D] and V^T [D, nk] of this head written straight into the panels lmi_pack_b /
                 * lmi_pack_bf16 would make of them (a pool row read into A's room first: free until the
                 * chunks); V^T's panel p is V's columns p * 32 .. p * 32 + 31 row after row, so V is never
                 * transposed (a 4 KiB-strided scalar scatter took a fifth of the attention) */
                for (int64_t t = 0; t < nk; ++t) {
                    const char *row = a_buf;
                    if (t < c0)
                        ctx_row(a_buf, pc, pc->kc, pc->ksc, pi, t, kh, D, bf16);
                    else
                        row = (const char *)k + ((t0 + t - c0) * ks + kh * khs) * es;
                    put_k_row(kp, row, t, D, bf16);
                }
                pad_k_rows(kp, nk, D, bf16);
                for (int64_t t = 0; t < nk; ++t) {
                    const char *row = a_buf;
                    if (t < c0)
                        ctx_row(a_buf, pc, pc->vc, pc->vsc, pi, t, kh, D, bf16);
                    else
                        row = (const char *)v + ((t0 + t - c0) * vs + kh * vhs) * es;
                    put_v_row(vp, row, t, nk, D, bf16);
                }
                if (bf16 && nk % 2)     /* the odd key's pair partner: zero */
                    for (int64_t c = 0; c < D; c += 32) {
                        uint16_t *last = (uint16_t *)vp + (c / 32 * kq + kq - 1) * 64;
                        for (int64_t j = 0; j < 32; ++j) last[2 * j + 1] = 0;
                    }
                for (int64_t i0 = 0; i0 < n; i0 += PQ) {
                    const int64_t i1 = i0 + PQ < n ? i0 + PQ : n, r = i1 - i0, m = g * r;
                    const int64_t seen = causal ? c0 + i1 : nk;    /* keys a row of this chunk may see */
                    const int64_t w = bf16 ? (seen + 1) / 2 * 2 : seen;    /* keys read: 0 .. seen - 1 (+ a zero) */
                    for (int64_t j = 0; j < g; ++j)     /* A row j * r + (i - i0): head kh * g + j at position i */
                        for (int64_t i = i0; i < i1; ++i)
                            memcpy(a_buf + ((j * r + i - i0) * D) * es,
                                   (const char *)q + ((t0 + i) * qs + (kh * g + j) * qh) * es, (size_t)(D * es));
                    if (bf16)
                        lmi_gemm_bf16((const uint16_t *)a_buf, m, D, D, (const uint16_t *)kp, seen, 0, s, npad, 0, 1);
                    else
                        lmi_gemm((const float *)a_buf, m, D, D, (const float *)kp, seen, 0, s, npad, 1);
                    for (int64_t j = 0; j < g; ++j)
                        for (int64_t i = i0; i < i1; ++i) {
                            float *sr = s + (j * r + i - i0) * npad;
                            const int64_t L = causal ? c0 + i + 1 : nk;
                            row_softmax(sr, L, (L + 15) / 16 * 16, scale);
                            for (int64_t t = L; t < w; ++t) sr[t] = 0.f;
                        }
                    for (int64_t c = 0; c < D; c += 32) {   /* O's 32-column panels, each over keys 0 .. w - 1 */
                        const int64_t nc = D - c < 32 ? D - c : 32;
                        if (bf16)   /* P stays fp32: V widened in registers, fp32 FMAs (no rounding of P) */
                            lmi_gemm_bf16w(s, m, w, npad, (const uint16_t *)vp + (c / 32) * kq * 64, nc, 0, o + c,
                                           dpad, 0, 1);
                        else
                            lmi_gemm(s, m, w, npad, (const float *)vp + (c / 32) * nk * 32, nc, 0, o + c, dpad, 1);
                    }
                    for (int64_t j = 0; j < g; ++j)
                        for (int64_t i = i0; i < i1; ++i) {
                            const float *orow = o + (j * r + i - i0) * dpad;
                            char *dst = (char *)out + ((t0 + i) * os + (kh * g + j) * oh) * es;
                            if (bf16)
                                for (int64_t d = 0; d < D; ++d) ((uint16_t *)dst)[d] = f32_to_bf16(orow[d]);
                            else
                                memcpy(dst, orow, (size_t)(D * 4));
                        }
                }
            }
        }
        free(mem);
    }
    return failed ? -2 : 0;
}

int lmi_prefill_attention(const void *q, const void *k, const void *v, int64_t qs, int64_t ks, int64_t vs,
                          int64_t qh, int64_t khs, int64_t vhs, void *out, int64_t os, int64_t oh, int bf16,
                          const int64_t *starts, const int64_t *lens,
                          const int64_t *order, int64_t P, int64_t H, int64_t Hkv, int64_t D, float scale,
                          const lmi_kv_ctx *pc, int nthreads) {
    return prompt_attention(q, k, v, qs, ks, vs, qh, khs, vhs, out, os, oh, bf16, starts, lens, order, P, H, Hkv, D,
                            scale, 1, pc, nthreads);
}

/* Bidirectional attention of an encoder's packed sequences, ER query rows at a time (no panels: an
 * encoder's sequences are mostly short, where packing K and V as GEMM weights cost more than the
 * products). Per (sequence, KV head) item: K^T [D, nk] and V [n, dp] of the head widened to fp32,
 * zero padded (nk: n up to a multiple of EK keys, dp: D up to a multiple of EV columns); then for
 * each of the g query heads, ER rows at a time: s = q K^T over EK-key tiles (ER independent sums in
 * registers across D, each K load feeding ER rows), softmax, o = P V over EV-column tiles (in
 * registers across the keys), o rounded once (bf16). The last block's missing rows repeat its last
 * row and are not written. Same arguments as prompt_attention (causal = 0). Returns 0, or -2 when
 * scratch memory ran out. */
#define EK 16
#define EV 32
#define ER 4
static int encoder_rows(const void *q, const void *k, const void *v, int64_t qs, int64_t ks, int64_t vs,
                        int64_t qh, int64_t khs, int64_t vhs, void *out, int64_t os, int64_t oh, int bf16,
                        const int64_t *starts, const int64_t *lens, const int64_t *order, int64_t P, int64_t H,
                        int64_t Hkv, int64_t D, float scale, int nthreads) {
    const int64_t g = H / Hkv, dp = (D + EV - 1) / EV * EV, es = bf16 ? 2 : 4;
    const int64_t nmax = longest(lens, P);
    const int64_t np = (nmax + EK - 1) / EK * EK;
    /* per thread: K^T [D, np]; V [nmax, dp]; s [ER, np]; the query rows [ER, D]; a row of K or V */
    const size_t per = (size_t)(D * np + nmax * dp + ER * np + ER * D + dp + 16) * sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *kt = scratch(per, &failed);
#pragma omp barrier
        if (!failed) {
            float *vv = kt + D * np, *s = vv + nmax * dp, *qr = s + ER * np, *kr = qr + ER * D;
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < P * Hkv; ++item) {
                const int64_t pi = order[item / Hkv], kh = item % Hkv;
                const int64_t n = lens[pi], t0 = starts[pi], nk = (n + EK - 1) / EK * EK;
                for (int64_t t = 0; t < n; ++t) {
                    load_row(kr, k, (t0 + t) * ks + kh * khs, D, bf16);
                    for (int64_t d = 0; d < D; ++d) kt[d * nk + t] = kr[d];
                    float *vr = vv + t * dp;
                    load_row(vr, v, (t0 + t) * vs + kh * vhs, D, bf16);
                    for (int64_t d = D; d < dp; ++d) vr[d] = 0.f;
                }
                for (int64_t d = 0; d < D; ++d)
                    for (int64_t t = n; t < nk; ++t) kt[d * nk + t] = 0.f;
                for (int64_t j = 0; j < g; ++j)
                    for (int64_t i0 = 0; i0 < n; i0 += ER) {
                        const int64_t rows = n - i0 < ER ? n - i0 : ER;
                        for (int64_t r = 0; r < ER; ++r)
                            load_row(qr + r * D, q, (t0 + i0 + (r < rows ? r : rows - 1)) * qs + (kh * g + j) * qh,
                                     D, bf16);
                        for (int64_t t = 0; t < nk; t += EK) {
                            float acc[ER][EK] = {{0}};
                            for (int64_t d = 0; d < D; ++d) {
                                const float *kd = kt + d * nk + t;
                                for (int r = 0; r < ER; ++r) {
                                    const float qd = qr[r * D + d];
#pragma omp simd
                                    for (int e = 0; e < EK; ++e) acc[r][e] += qd * kd[e];
                                }
                            }
                            for (int r = 0; r < ER; ++r) memcpy(s + r * nk + t, acc[r], sizeof acc[r]);
                        }
                        for (int64_t r = 0; r < rows; ++r) row_softmax(s + r * nk, n, nk, scale);
                        for (int64_t c = 0; c < dp; c += EV) {
                            float acc[ER][EV] = {{0}};
                            for (int64_t t = 0; t < n; ++t) {
                                const float *vr = vv + t * dp + c;
                                for (int r = 0; r < ER; ++r) {
                                    const float pt = s[r * nk + t];
#pragma omp simd
                                    for (int e = 0; e < EV; ++e) acc[r][e] += pt * vr[e];
                                }
                            }
                            const int64_t w = D - c < EV ? D - c : EV;
                            for (int64_t r = 0; r < rows; ++r) {
                                char *dst = (char *)out + ((t0 + i0 + r) * os + (kh * g + j) * oh) * es;
                                if (bf16)
                                    for (int64_t e = 0; e < w; ++e) ((uint16_t *)dst)[c + e] = f32_to_bf16(acc[r][e]);
                                else
                                    memcpy((float *)dst + c, acc[r], (size_t)w * sizeof(float));
                            }
                        }
                    }
            }
        }
        free(kt);
    }
    return failed ? -2 : 0;
}

/* Sequences of at least ENC_PANEL_MIN rows go to the panel GEMMs (prompt_attention, causal = 0) where the
 * build has them: packing K and V^T pays off past ~64 rows (2 threads, 12 heads of 64: 1024 rows 1.3x
 * faster in fp32, 2x in bf16; 16 rows 1.6x slower). One kernel a call, chosen by where most of the
 * work (rows^2) lies; the two differ in rounding only (as the GEMMs do between batch shapes). */
#define ENC_PANEL_MIN 128

int lmi_encoder_attention(const void *q, const void *k, const void *v, int64_t qs, int64_t ks, int64_t vs,
                          int64_t qh, int64_t khs, int64_t vhs, void *out, int64_t os, int64_t oh, int bf16,
                          const int64_t *starts, const int64_t *lens,
                          const int64_t *order, int64_t P, int64_t H, int64_t Hkv, int64_t D, float scale,
                          int nthreads) {
    double longw = 0, shortw = 0;
    for (int64_t p = 0; p < P; ++p) {
        const double w = (double)lens[p] * (double)lens[p];
        if (lens[p] >= ENC_PANEL_MIN) longw += w; else shortw += w;
    }
    const int panels = bf16 ? lmi_gemm_bf16_available() && lmi_gemm_bf16w_available() : lmi_gemm_available();
    if (panels && longw >= shortw)
        return prompt_attention(q, k, v, qs, ks, vs, qh, khs, vhs, out, os, oh, bf16, starts, lens, order, P, H, Hkv,
                                D, scale, 0, NULL, nthreads);
    return encoder_rows(q, k, v, qs, ks, vs, qh, khs, vhs, out, os, oh, bf16, starts, lens, order, P, H, Hkv, D,
                        scale, nthreads);
}
