/* The CPU kernels' aarch64 NEON build against plain C references, run under qemu-user by
 * tests/kernels/test_arm_neon.py (linked with the kernels' C sources, built as kernels/cpu/ builds them).
 *
 * Prints one line per kernel family:
 *   AVAIL <name> 0|1          what the build says it provides (lmi_*_available)
 *   CHECK <name> PASS|FAIL <detail>
 * and "DONE" last. A kernel reported available must have a CHECK line that passed.
 * Exact where the contract is bit for bit (the panel GEMMs against fmaf in k order from 0, then
 * + bias; int8 bytes and integer sums; KV writes; the rotary embedding; SiLU with a plain expf
 * standing in for Sleef's), tolerances against double references elsewhere.
 * Built with -ffp-contract=off: the references' products and sums round one by one. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_bf16.h"

/* A vector exp of the build's lanes that calls expf lane by lane (torch's Sleef stands in) */
#if defined(__aarch64__)
#include <arm_neon.h>
typedef float32x4_t vexp_t;
#elif defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vexp_t;
#elif defined(__AVX2__)
#include <immintrin.h>
typedef __m256 vexp_t;
#else
typedef float vexp_t;
#endif
#define PLAIN_LANES ((int)(sizeof(vexp_t) / sizeof(float)))
static vexp_t plain_expf_v(vexp_t x) {
    float v[16];
    memcpy(v, &x, sizeof x);
    for (int i = 0; i < PLAIN_LANES; ++i) v[i] = expf(v[i]);
    memcpy(&x, v, sizeof x);
    return x;
}

/* the entry points cpu_api.h does not declare */
int lmi_gemm_available(void);
int lmi_gemm_bf16_available(void);
int lmi_gemm_bf16w_available(void);
int lmi_gemm_i8_available(void);
int lmi_gemm_q_available(void);
int lmi_silu_available(void);
int lmi_silu_lanes(void);
void lmi_set_sleef_expf(void *fn, int lanes);
void lmi_silu_mul(void *g, const void *u, int64_t n, int bf16, int threads);
void lmi_bf16_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint16_t *out, int64_t ldo, int nthreads);
void lmi_pack_i8(const int8_t *W, int64_t N, int64_t K, int8_t *out, int32_t *wsum);
void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const void *S,
                const void *Mn, const float *D, const float *E, int smode, int64_t sg, int bits, int64_t g, int64_t N,
                const float *bias, float *C, int64_t ldc, int act8, int nthreads);
int lmi_decode_attention(const float *q, const void *kc, const void *vc, int kv_bf16, int64_t s_blk, int64_t s_tok,
                         int64_t s_head, const int32_t *tables, int64_t tw, const int32_t *lens, int64_t B, int64_t H,
                         int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t window, float softcap, float *out,
                         int nthreads);
void lmi_row_stats(const float *x, int64_t rows, int64_t V, int64_t ld, int64_t *argmax, float *maxv, float *logsum,
                   int nthreads);

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void) {   /* uniform in [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
}
static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; ++i) x[i] = frand() * scale;
}
static void *alloc(size_t bytes) {
    void *p = calloc(1, bytes + 64);
    if (!p) {
        printf("CHECK alloc FAIL out of memory\n");
        exit(1);
    }
    return p;
}

static int failures = 0;
static void report(const char *name, int ok, const char *detail) {
    printf("CHECK %s %s %s\n", name, ok ? "PASS" : "FAIL", detail);
    fflush(stdout);
    failures += !ok;
}

static const int THREADS[] = {1, 3};

/* ---------------------------------------------------------------- fp32 panel GEMM */
static void ref_gemm(const float *A, int64_t M, int64_t K, int64_t lda, const float *W, int64_t N, const float *bias,
                     float *C) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) acc = fmaf(A[m * lda + k], W[n * K + k], acc);
            C[m * N + n] = bias ? acc + bias[n] : acc;
        }
}

static void check_gemm(void) {
    /* K 1024: rows 4 KiB apart, copied to another stride by kernels/cpu_panel.h (lmi_panel_pad) past 8 rows */
    static const int64_t MS[] = {1, 3, 5, 13, 14, 15, 37},
                         KN[][2] = {{64, 1}, {96, 17}, {100, 70}, {33, 32}, {1024, 40}};
    int ok = 1, cases = 0;
    char detail[160] = "";
    for (size_t a = 0; a < sizeof KN / sizeof KN[0]; ++a)
        for (size_t b = 0; b < sizeof MS / sizeof MS[0]; ++b)
            for (int bi = 0; bi < 2; ++bi) {
                const int64_t K = KN[a][0], N = KN[a][1], M = MS[b], lda = K % 1024 ? K + 3 : K, np = (N + 31) / 32;
                float *A = alloc(sizeof(float) * M * lda), *W = alloc(sizeof(float) * N * K);
                float *bias = alloc(sizeof(float) * N), *P = alloc(sizeof(float) * np * 32 * K);
                float *C = alloc(sizeof(float) * M * N), *R = alloc(sizeof(float) * M * N);
                fill(A, M * lda, 2.f);
                fill(W, N * K, 1.f);
                fill(bias, N, 1.f);
                lmi_pack_b(W, N, K, P);
                ref_gemm(A, M, K, lda, W, N, bi ? bias : NULL, R);
                for (int t = 0; t < 2; ++t) {
                    memset(C, 0xff, sizeof(float) * M * N);
                    lmi_gemm(A, M, K, M > 1 ? lda : K, P, N, bi ? bias : NULL, C, N, THREADS[t]);
                    ++cases;
                    if (memcmp(C, R, sizeof(float) * M * N) && ok) {
                        ok = 0;
                        snprintf(detail, sizeof detail, "M=%ld K=%ld N=%ld bias=%d threads=%d: not bit-equal",
                                 (long)M, (long)K, (long)N, bi, THREADS[t]);
                    }
                }
                free(A), free(W), free(bias), free(P), free(C), free(R);
            }
    if (ok) snprintf(detail, sizeof detail, "%d cases bit-equal to fmaf in k order", cases);
    report("gemm", ok, detail);
}

/* ---------------------------------------------------------------- bf16 weights */
static void check_gemm_bf16w(void) {
    static const int64_t MS[] = {1, 4, 12, 13, 30}, KN[][2] = {{64, 5}, {97, 40}, {128, 64}, {1024, 33}};
    int ok = 1, cases = 0;
    char detail[160] = "";
    for (size_t a = 0; a < 4; ++a)
        for (size_t b = 0; b < 5; ++b)
            for (int ob = 0; ob < 2; ++ob) {
                const int64_t K = KN[a][0], N = KN[a][1], M = MS[b], np = (N + 31) / 32, kq = (K + 1) / 2;
                float *A = alloc(sizeof(float) * M * K), *Wf = alloc(sizeof(float) * N * K);
                uint16_t *W = alloc(2 * N * K), *P = alloc(2 * np * 32 * kq * 2);
                float *bias = alloc(sizeof(float) * N), *R = alloc(sizeof(float) * M * N);
                void *C = alloc(sizeof(float) * M * N);
                fill(A, M * K, 2.f);
                fill(bias, N, 1.f);
                for (int64_t i = 0; i < N * K; ++i) {
                    W[i] = f32_to_bf16(frand());
                    Wf[i] = bf16_to_f32(W[i]);
                }
                lmi_pack_bf16(W, N, K, P);
                ref_gemm(A, M, K, K, Wf, N, bias, R);
                for (int t = 0; t < 2; ++t) {
                    lmi_gemm_bf16w(A, M, K, K, P, N, bias, C, N, ob, THREADS[t]);
                    ++cases;
                    int same = 1;
                    for (int64_t i = 0; i < M * N && same; ++i)
                        same = ob ? ((uint16_t *)C)[i] == f32_to_bf16(R[i]) : ((float *)C)[i] == R[i];
                    if (!same && ok) {
                        ok = 0;
                        snprintf(detail, sizeof detail, "M=%ld K=%ld N=%ld out_bf16=%d threads=%d: not bit-equal",
                                 (long)M, (long)K, (long)N, ob, THREADS[t]);
                    }
                }
                free(A), free(Wf), free(W), free(P), free(bias), free(R), free(C);
            }
    if (ok) snprintf(detail, sizeof detail, "%d cases bit-equal to fmaf over the widened weight", cases);
    report("gemm_bf16w", ok, detail);
}

/* bf16 dot products: each pair's products added in the instruction's own order, so within the fp32
 * sum's bound of the float64 product (and the bf16 rows of an fp32 A: lmi_bf16_rows, exact) */
static void check_gemm_bf16(void) {
    const int64_t M = 9, K = 131, N = 45, np = (N + 31) / 32, kq = (K + 1) / 2;
    float *Af = alloc(sizeof(float) * M * K), *bias = alloc(sizeof(float) * N);
    uint16_t *A = alloc(2 * M * K), *Ar = alloc(2 * M * K), *W = alloc(2 * N * K), *P = alloc(2 * np * 32 * kq * 2);
    float *C = alloc(sizeof(float) * M * N);
    fill(Af, M * K, 2.f);
    fill(bias, N, 1.f);
    for (int64_t i = 0; i < M * K; ++i) A[i] = f32_to_bf16(Af[i]);
    for (int64_t i = 0; i < N * K; ++i) W[i] = f32_to_bf16(frand());
    lmi_bf16_rows(Af, M, K, K, Ar, K, 2);
    int ok = memcmp(A, Ar, 2 * M * K) == 0;
    char detail[160] = "lmi_bf16_rows differs from round-to-nearest-even";
    lmi_pack_bf16(W, N, K, P);
    double worst = 0;
    for (int t = 0; t < 2 && ok; ++t) {
        lmi_gemm_bf16(A, M, K, K, P, N, bias, C, N, 0, THREADS[t]);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
                double s = bias[n], mag = fabs(bias[n]);
                for (int64_t k = 0; k < K; ++k) {
                    const double p = (double)bf16_to_f32(A[m * K + k]) * bf16_to_f32(W[n * K + k]);
                    s += p;
                    mag += fabs(p);
                }
                const double err = fabs(C[m * N + n] - s) / (mag * K * 0x1p-24 + 1e-30);
                worst = err > worst ? err : worst;
            }
    }
    if (ok) {
        ok = worst <= 1.0;
        snprintf(detail, sizeof detail, "within %.3f of the fp32 sum bound (K 2^-24 sum|a w|); bf16 rows exact",
                 worst);
    }
    report("gemm_bf16", ok, detail);
    free(Af), free(bias), free(A), free(Ar), free(W), free(P), free(C);
}

/* ---------------------------------------------------------------- int8 */
static void ref_quant(const float *a, int64_t K, int64_t Kp, uint8_t *o, float *scale) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = fabsf(a[k]) > amax ? fabsf(a[k]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    *scale = amax / 127.f;
    for (int64_t k = 0; k < K; ++k) {
        float q = nearbyintf(a[k] * inv);
        q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
        o[k] = (uint8_t)((int)q + 128);
    }
    for (int64_t k = K; k < Kp; ++k) o[k] = 128;
}

static void check_gemm_i8(void) {
    /* K 4096: rows of Kp bytes 4 KiB apart, copied to another stride (kernels/cpu_panel.h) past 8 rows */
    static const int64_t MS[] = {1, 2, 7, 14, 15, 29}, KN[][2] = {{64, 3}, {99, 40}, {256, 96}, {4096, 33}};
    int ok = 1, cases = 0;
    char detail[160] = "";
    for (size_t a = 0; a < 4; ++a)
        for (size_t b = 0; b < 6; ++b) {
            const int64_t K = KN[a][0], N = KN[a][1], M = MS[b], Kp = (K + 3) / 4 * 4, np = (N + 31) / 32;
            float *A = alloc(sizeof(float) * M * K), *sa = alloc(4 * M), *rsa = alloc(4 * M);
            float *sw = alloc(4 * N), *bias = alloc(4 * N), *C = alloc(4 * M * N);
            uint8_t *Aq = alloc(M * Kp), *Rq = alloc(M * Kp);
            int8_t *W = alloc(N * K), *P = alloc(np * 32 * Kp);
            int32_t *wsum = alloc(4 * np * 32);
            fill(A, M * K, 3.f);
            if (M > 2) memset(A + K, 0, sizeof(float) * K);     /* an all-zero row: scale 0 */
            A[0] = 5.f;
            for (int64_t i = 0; i < N * K; ++i) W[i] = (int8_t)(frand() * 127.f);
            W[0] = -128;
            for (int64_t n = 0; n < N; ++n) sw[n] = 0.01f + 0.001f * (float)n;
            fill(bias, N, 1.f);
            for (int64_t m = 0; m < M; ++m) ref_quant(A + m * K, K, Kp, Rq + m * Kp, rsa + m);
            lmi_pack_i8(W, N, K, P, wsum);
            for (int t = 0; t < 2; ++t)
                for (int bi = 0; bi < 2; ++bi) {
                    lmi_quant_rows(A, M, K, K, Aq, Kp, sa, THREADS[t]);
                    ++cases;
                    if ((memcmp(Aq, Rq, M * Kp) || memcmp(sa, rsa, 4 * M)) && ok) {
                        ok = 0;
                        snprintf(detail, sizeof detail, "lmi_quant_rows M=%ld K=%ld: bytes or scales differ",
                                 (long)M, (long)K);
                    }
                    lmi_gemm_i8(Aq, M, Kp, sa, P, wsum, sw, N, bi ? bias : NULL, C, N, THREADS[t]);
                    for (int64_t m = 0; m < M && ok; ++m)
                        for (int64_t n = 0; n < N; ++n) {
                            int64_t acc = 0, ws = 0;
                            for (int64_t k = 0; k < K; ++k) {
                                acc += (int64_t)Rq[m * Kp + k] * W[n * K + k];
                                ws += W[n * K + k];
                            }
                            acc -= 128 * ws;
                            const float want = fmaf((float)acc * sw[n], rsa[m], bi ? bias[n] : 0.f);
                            if (C[m * N + n] != want) {
                                ok = 0;
                                snprintf(detail, sizeof detail, "M=%ld K=%ld N=%ld bias=%d: C[%ld,%ld] %g != %g",
                                         (long)M, (long)K, (long)N, bi, (long)m, (long)n, C[m * N + n], want);
                                break;
                            }
                        }
                }
            free(A), free(sa), free(rsa), free(sw), free(bias), free(C), free(Aq), free(Rq), free(W), free(P),
                free(wsum);
        }
    if (ok) snprintf(detail, sizeof detail, "%d cases: quant_rows bytes and exact integer sums, epilogue fmaf", cases);
    report("gemm_i8", ok, detail);
}

/* ---------------------------------------------------------------- grouped 4/5/6/8-bit */
static uint16_t f16_bits(float x) {     /* a positive or negative normal fp16 value, exactly */
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(((u >> 16) & 0x8000) | ((((u >> 23) & 0xFF) - 112) << 10) | ((u >> 13) & 0x3FF));
}

/* kernels/cpu_gemm_q4.c's layouts (codes: nibbles, bit planes, bytes; scales: fp32, fp16, two levels)
 * against ref_gemm over fma(q, s, m), bit for bit. */
static void check_gemm_q(void) {
    static const int64_t MS[] = {1, 3, 12, 13, 40};
    static const int BITS[] = {4, 5, 6, 8};
    int ok = 1, cases = 0;
    char detail[160] = "";
    for (int bi = 0; bi < 4; ++bi)
        for (int smode = 0; smode < 3; ++smode)
            for (size_t b = 0; b < 5; ++b) {
                const int bits = BITS[bi];
                const int64_t M = MS[b], K = 128, N = 45, g = 32, G = K / g, np = (N + 31) / 32, sg = 2;
                const int64_t row = bits == 8 ? 32 : 16 + 4 * (bits - 4), tab = np * G * 32;
                float *A = alloc(4 * M * K), *Sf = alloc(4 * tab), *Mf = alloc(4 * tab);
                float *D = alloc(4 * np * (G / sg) * 32), *E = alloc(4 * np * (G / sg) * 32);
                uint16_t *S16 = alloc(2 * tab), *M16 = alloc(2 * tab);
                int8_t *Sa = alloc(tab), *Mb = alloc(tab);
                float *Wf = alloc(4 * N * K), *bias = alloc(4 * N), *C = alloc(4 * M * N), *R = alloc(4 * M * N);
                uint8_t *q = alloc(N * K), *P = alloc(np * K * row);
                fill(A, M * K, 2.f);
                fill(bias, N, 1.f);
                for (int64_t i = 0; i < N * K; ++i) q[i] = (uint8_t)((frand() + 1.f) * 0.4999f * (float)(1 << bits));
                for (int64_t i = 0; i < np * (G / sg) * 32; ++i) {
                    D[i] = 0.0078125f * (1.f + 0.5f * frand());
                    E[i] = -0.25f * D[i];
                }
                for (int64_t n = 0; n < np * 32; ++n)
                    for (int64_t gi = 0; gi < G; ++gi) {
                        const int64_t at = ((n / 32) * G + gi) * 32 + n % 32, dt = ((n / 32) * (G / sg) + gi / sg) * 32 + n % 32;
                        Sa[at] = (int8_t)(n < N ? 8 + (int)(7.9f * frand()) : 0);
                        Mb[at] = (int8_t)(n < N ? (int)(60.f * frand()) : 0);
                        if (smode == 2) {
                            Sf[at] = D[dt] * (float)Sa[at];
                            Mf[at] = E[dt] * (float)Mb[at];
                        } else {   /* fp16-exact values: 1/16 .. 3/32 in steps of 2^-14, their min -8x */
                            Sf[at] = n < N ? 0.0625f + (float)(int)(256.f * (frand() + 1.f)) * 0x1p-14f : 0.f;
                            Mf[at] = -8.f * Sf[at];
                        }
                        S16[at] = Sf[at] == 0.f ? 0 : f16_bits(Sf[at]);
                        M16[at] = Mf[at] == 0.f ? 0 : f16_bits(Mf[at]);
                    }
                for (int64_t n = 0; n < N; ++n)
                    for (int64_t k = 0; k < K; ++k) {
                        const int64_t at = ((n / 32) * G + k / g) * 32 + n % 32;
                        Wf[n * K + k] = fmaf((float)q[n * K + k], Sf[at], Mf[at]);
                    }
                for (int64_t p = 0; p < np; ++p)   /* handler/model/quant_int4.py's pack */
                    for (int64_t k = 0; k < K; ++k) {
                        uint8_t *r = P + (p * K + k) * row;
                        memset(r, 0, (size_t)row);
                        for (int64_t j = 0; j < 32; ++j) {
                            const int64_t n = p * 32 + j;
                            const uint8_t c = n < N ? q[n * K + k] : 0;
                            if (bits == 8) {
                                r[j] = c;
                                continue;
                            }
                            r[j % 16] |= (uint8_t)((c & 15) << (j < 16 ? 0 : 4));
                            for (int pl = 0; pl < bits - 4; ++pl)
                                r[16 + 4 * pl + j / 8] |= (uint8_t)(((c >> (4 + pl)) & 1) << (j % 8));
                        }
                    }
                ref_gemm(A, M, K, K, Wf, N, bias, R);
                const void *S = smode == 0 ? (const void *)Sf : smode == 1 ? (const void *)S16 : (const void *)Sa;
                const void *Mn = smode == 0 ? (const void *)Mf : smode == 1 ? (const void *)M16 : (const void *)Mb;
                for (int t = 0; t < 2; ++t) {
                    lmi_gemm_q(A, M, K, K, P, S, Mn, D, E, smode, sg, bits, g, N, bias, C, N, 0, THREADS[t]);
                    ++cases;
                    if (memcmp(C, R, 4 * M * N) && ok) {
                        ok = 0;
                        snprintf(detail, sizeof detail, "bits=%d smode=%d M=%ld: not bit-equal to fmaf over fma(q, s, m)",
                                 bits, smode, (long)M);
                    }
                }
                free(A), free(Sf), free(Mf), free(D), free(E), free(S16), free(M16), free(Sa), free(Mb);
                free(Wf), free(bias), free(C), free(R), free(q), free(P);
            }
    if (ok) snprintf(detail, sizeof detail, "%d cases bit-equal to the fp32 GEMM over the dequantized weight", cases);
    report("gemm_q", ok, detail);
}

/* ---------------------------------------------------------------- element-wise and norms */
static void check_rotary(void) {
    const int64_t T = 5, H = 4, Hkv = 2, D = 32, half = D / 2;
    int ok = 1;
    for (int bf = 0; bf < 2 && ok; ++bf) {
        const int64_t es = bf ? 2 : 4, qs = H * D + 8, ks = Hkv * D + 8;
        char *q = alloc(es * T * qs), *k = alloc(es * T * ks), *c = alloc(es * T * D), *s = alloc(es * T * D);
        char *q0 = alloc(es * T * qs);
        float *tmp = alloc(4 * T * qs);
        for (int64_t i = 0; i < T * qs; ++i) tmp[i] = frand() * 2.f;
        for (int64_t i = 0; i < T * qs; ++i) {
            if (bf) ((uint16_t *)q)[i] = f32_to_bf16(tmp[i]); else ((float *)q)[i] = tmp[i];
        }
        for (int64_t i = 0; i < T * ks; ++i) {
            if (bf) ((uint16_t *)k)[i] = f32_to_bf16(frand()); else ((float *)k)[i] = frand();
        }
        for (int64_t i = 0; i < T * D; ++i) {
            const float a = cosf(0.1f * (float)i), b = sinf(0.1f * (float)i);
            if (bf) ((uint16_t *)c)[i] = f32_to_bf16(a), ((uint16_t *)s)[i] = f32_to_bf16(b);
            else ((float *)c)[i] = a, ((float *)s)[i] = b;
        }
        memcpy(q0, q, es * T * qs);
        lmi_rotary(q, k, c, s, T, H, Hkv, D, qs, ks, D, bf, 2);
        for (int64_t t = 0; t < T && ok; ++t)
            for (int64_t h = 0; h < H && ok; ++h)
                for (int64_t i = 0; i < half; ++i) {
                    const int64_t at = t * qs + h * D + i;
                    if (bf) {
                        const uint16_t *x = (uint16_t *)q0, *cc = (uint16_t *)c + t * D, *ss = (uint16_t *)s + t * D;
                        const float a = bf16_to_f32(x[at]), b = bf16_to_f32(x[at + half]);
                        const float lo = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(cc[i]))) +
                                         bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(ss[i])));
                        const float hi = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(cc[i + half]))) +
                                         bf16_to_f32(f32_to_bf16(a * bf16_to_f32(ss[i + half])));
                        ok = ((uint16_t *)q)[at] == f32_to_bf16(lo) && ((uint16_t *)q)[at + half] == f32_to_bf16(hi);
                    } else {
                        const float *x = (float *)q0, *cc = (float *)c + t * D, *ss = (float *)s + t * D;
                        const float a = x[at], b = x[at + half];
                        ok = ((float *)q)[at] == a * cc[i] + (-b) * ss[i] &&
                             ((float *)q)[at + half] == b * cc[i + half] + a * ss[i + half];
                    }
                }
        free(q), free(k), free(c), free(s), free(q0), free(tmp);
    }
    report("rotary", ok, ok ? "fp32 and bf16 bit-equal to torch's rounding" : "differs");
}

static void check_write_kv(void) {
    const int64_t NB = 6, bs = 4, Hkv = 2, D = 16, T = 5, s_blk = bs * Hkv * D, s_tok = Hkv * D, s_head = D;
    float *kc = alloc(4 * NB * s_blk), *vc = alloc(4 * NB * s_blk), *key = alloc(4 * T * Hkv * D);
    float *val = alloc(4 * T * Hkv * D);
    const int64_t slots[] = {3, 9, -1, 17, 22}, bad[] = {3, 24};
    fill(key, T * Hkv * D, 1.f);
    fill(val, T * Hkv * D, 1.f);
    int ok = lmi_write_kv(kc, vc, key, val, 4, s_blk, s_tok, s_head, Hkv * D, D, Hkv * D, D, slots, T, Hkv, D, bs,
                          NB * bs) == 0;
    for (int64_t t = 0; t < T && ok; ++t) {
        if (slots[t] < 0) continue;
        const int64_t base = (slots[t] / bs) * s_blk + (slots[t] % bs) * s_tok;
        ok = !memcmp(kc + base, key + t * Hkv * D, 4 * Hkv * D) && !memcmp(vc + base, val + t * Hkv * D, 4 * Hkv * D);
    }
    float *before = alloc(4 * NB * s_blk);
    memcpy(before, kc, 4 * NB * s_blk);
    ok = ok && lmi_write_kv(kc, vc, key, val, 4, s_blk, s_tok, s_head, Hkv * D, D, Hkv * D, D, bad, 2, Hkv, D, bs,
                            NB * bs) == -1 && !memcmp(before, kc, 4 * NB * s_blk);
    report("write_kv", ok, ok ? "rows at their slots, a negative slot skipped, a slot past the pool refused" : "differs");
    free(kc), free(vc), free(key), free(val), free(before);
}

static void check_rms_norms(void) {
    const int64_t rows = 3, H = 200;
    float *x = alloc(4 * rows * H), *w = alloc(4 * H), *out = alloc(4 * rows * H), *sq = alloc(4 * H);
    uint16_t *xb = alloc(2 * rows * H), *wb = alloc(2 * H), *ob = alloc(2 * rows * H);
    fill(x, rows * H, 2.f);
    fill(w, H, 1.f);
    for (int64_t i = 0; i < rows * H; ++i) xb[i] = f32_to_bf16(x[i]);
    for (int64_t i = 0; i < H; ++i) wb[i] = f32_to_bf16(w[i]);
    double worst32 = 0;
    int worst16 = 0;
    for (int W = 1; W <= 16; W *= 2) {
        lmi_rms_norm_f32(x, w, out, rows, H, 1e-6f, W, sq);
        for (int64_t r = 0; r < rows; ++r) {
            double ss = 0;
            for (int64_t i = 0; i < H; ++i) ss += (double)x[r * H + i] * x[r * H + i];
            const double inv = 1.0 / sqrt(ss / H + 1e-6);
            for (int64_t i = 0; i < H; ++i) {
                const double e = fabs(out[r * H + i] - w[i] * x[r * H + i] * inv) / (fabs(w[i] * x[r * H + i] * inv) + 1e-6);
                worst32 = e > worst32 ? e : worst32;
            }
        }
    }
    lmi_rms_norm_bf16(xb, wb, ob, rows, H, 1e-6f, 2);
    for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < H; ++i) ss += (double)bf16_to_f32(xb[r * H + i]) * bf16_to_f32(xb[r * H + i]);
        const float inv = (float)(1.0 / sqrt(ss / H + 1e-6));
        for (int64_t i = 0; i < H; ++i) {
            const uint16_t want =
                f32_to_bf16(bf16_to_f32(wb[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xb[r * H + i]) * inv)));
            const int d = abs((int)(int16_t)ob[r * H + i] - (int)(int16_t)want);
            worst16 = d > worst16 ? d : worst16;
        }
    }
    char detail[160];
    snprintf(detail, sizeof detail, "fp32 (every summing width) within %.2g relative; bf16 within %d ulp", worst32,
             worst16);
    report("rms_norm", worst32 < 1e-5 && worst16 <= 1, detail);
    free(x), free(w), free(out), free(sq), free(xb), free(wb), free(ob);
}

static void check_row_stats(void) {
    const int64_t rows = 3, V = 49157, ld = V + 3;
    float *x = alloc(4 * rows * ld), *mx = alloc(4 * rows), *ls = alloc(4 * rows);
    int64_t *am = alloc(8 * rows);
    fill(x, rows * ld, 16.f);
    x[7] = 40.f;
    x[V - 1] = 40.f;   /* a tie: the first index */
    lmi_row_stats(x, rows, V, ld, am, mx, ls, 2);
    int ok = 1;
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * ld;
        int64_t at = 0;
        for (int64_t v = 1; v < V; ++v)
            if (xr[v] > xr[at]) at = v;
        double s = 0;
        for (int64_t v = 0; v < V; ++v) s += exp((double)xr[v] - xr[at]);
        ok = ok && am[r] == at && mx[r] == xr[at];
        const double e = fabs(ls[r] - log(s));
        worst = e > worst ? e : worst;
    }
    char detail[160];
    snprintf(detail, sizeof detail, "argmax (first of a tie) and max exact, log-sum-exp within %.2g", worst);
    report("row_stats", ok && worst < 1e-5, detail);
    free(x), free(mx), free(ls), free(am);
}

/* SiLU with a plain expf standing in for torch's Sleef (its lanes the build's): then the kernel's
 * split into vectors and tail changes nothing, and every value is x / (1 + expf(-x)) * u exactly. */
static void check_silu(void) {
    int ok = 1;
    char detail[160] = "";
    lmi_set_sleef_expf((void *)plain_expf_v, PLAIN_LANES);
    if (!lmi_silu_available()) {
        report("silu", 0, "lmi_silu_available() is 0 after lmi_set_sleef_expf(fn, its lanes)");
        return;
    }
    static const int64_t NS[] = {1, 7, 15, 16, 17, 33, 100, 32768 + 5, 70001};
    for (size_t a = 0; a < sizeof NS / sizeof NS[0] && ok; ++a)
        for (int bf = 0; bf < 2 && ok; ++bf)
            for (int t = 0; t < 2 && ok; ++t) {
                const int64_t n = NS[a];
                float *x = alloc(4 * n), *u = alloc(4 * n);
                fill(x, n, 8.f);
                fill(u, n, 1.f);
                for (int64_t i = 0; i < n; i += 13) x[i] = -200.f;
                for (int64_t i = 5; i < n; i += 29) x[i] = 150.f;
                void *g = alloc(4 * n), *uu = alloc(4 * n);
                for (int64_t i = 0; i < n; ++i) {
                    if (bf) ((uint16_t *)g)[i] = f32_to_bf16(x[i]), ((uint16_t *)uu)[i] = f32_to_bf16(u[i]);
                    else ((float *)g)[i] = x[i], ((float *)uu)[i] = u[i];
                }
                lmi_silu_mul(g, uu, n, bf, THREADS[t]);
                for (int64_t i = 0; i < n && ok; ++i) {
                    if (bf) {
                        const float xi = bf16_to_f32(f32_to_bf16(x[i]));
                        const uint16_t s = f32_to_bf16(xi / (1.f + expf(-xi)));
                        const uint16_t want = f32_to_bf16(bf16_to_f32(s) * bf16_to_f32(((uint16_t *)uu)[i]));
                        ok = ((uint16_t *)g)[i] == want;
                    } else {
                        ok = ((float *)g)[i] == x[i] / (1.f + expf(-x[i])) * u[i];
                    }
                    if (!ok) snprintf(detail, sizeof detail, "n=%ld bf16=%d threads=%d: element %ld", (long)n, bf,
                                      THREADS[t], (long)i);
                }
                free(x), free(u), free(g), free(uu);
            }
    if (ok) snprintf(detail, sizeof detail, "fp32 and bf16, %d lanes, bit-equal to x / (1 + expf(-x)) * u",
                     lmi_silu_lanes());
    report("silu", ok, detail);
}

/* ---------------------------------------------------------------- attention */
/* Decode attention over a paged pool (fp32 or bf16) against float64, then lmi_decode_fused against
 * rotary + write_kv + decode attention called one by one (the same bits). */
static void check_decode_attention(void) {
    const int64_t B = 3, H = 8, Hkv = 2, D = 64, bs = 4, NB = 24, tw = 8, g = H / Hkv;
    const int64_t s_tok = Hkv * D, s_blk = bs * s_tok, s_head = D;
    const int32_t lens[] = {1, 13, 29};
    int32_t tables[3 * 8];
    for (int64_t i = 0; i < B * tw; ++i) tables[i] = (int32_t)((i * 7 + 3) % NB);
    double worst = 0;
    int ok = 1;
    for (int bf = 0; bf < 2; ++bf)
        for (int64_t window = 0; window <= 5; window += 5) {
            const int64_t es = bf ? 2 : 4;
            char *kc = alloc(es * NB * s_blk), *vc = alloc(es * NB * s_blk);
            float *q = alloc(4 * B * H * D), *out = alloc(4 * B * H * D);
            for (int64_t i = 0; i < NB * s_blk; ++i) {
                const float a = frand(), b = frand();
                if (bf) ((uint16_t *)kc)[i] = f32_to_bf16(a), ((uint16_t *)vc)[i] = f32_to_bf16(b);
                else ((float *)kc)[i] = a, ((float *)vc)[i] = b;
            }
            fill(q, B * H * D, 1.f);
            const float scale = 0.125f;
            ok = ok && lmi_decode_attention(q, kc, vc, bf, s_blk, s_tok, s_head, tables, tw, lens, B, H, Hkv, D, bs,
                                            scale, window, 0.f, out, 2) == 0;
            for (int64_t b = 0; b < B; ++b)
                for (int64_t h = 0; h < H; ++h) {
                    const int64_t kh = h / g, L = lens[b], t0 = window && L > window ? L - window : 0;
                    double s[64], m = -1e300, sum = 0, o[64] = {0};
                    for (int64_t t = t0; t < L; ++t) {
                        const int64_t at = (int64_t)tables[b * tw + t / bs] * s_blk + (t % bs) * s_tok + kh * s_head;
                        double d = 0;
                        for (int64_t i = 0; i < D; ++i)
                            d += (double)q[(b * H + h) * D + i] *
                                 (bf ? bf16_to_f32(((uint16_t *)kc)[at + i]) : ((float *)kc)[at + i]);
                        s[t] = d * scale;
                        m = s[t] > m ? s[t] : m;
                    }
                    for (int64_t t = t0; t < L; ++t) sum += (s[t] = exp(s[t] - m));
                    for (int64_t t = t0; t < L; ++t) {
                        const int64_t at = (int64_t)tables[b * tw + t / bs] * s_blk + (t % bs) * s_tok + kh * s_head;
                        for (int64_t i = 0; i < D; ++i)
                            o[i] += s[t] / sum * (bf ? bf16_to_f32(((uint16_t *)vc)[at + i]) : ((float *)vc)[at + i]);
                    }
                    for (int64_t i = 0; i < D; ++i) {
                        const double e = fabs(out[(b * H + h) * D + i] - o[i]);
                        worst = e > worst ? e : worst;
                    }
                }
            free(kc), free(vc), free(q), free(out);
        }
    /* decode_fused (fp32) = rotary, write_kv, attention one by one */
    {
        const int64_t es = 4, nq = (H + 2 * Hkv) * D;
        float *kc = alloc(es * NB * s_blk), *vc = alloc(es * NB * s_blk), *kc2 = alloc(es * NB * s_blk);
        float *vc2 = alloc(es * NB * s_blk), *qkv = alloc(4 * B * nq), *qkv2 = alloc(4 * B * nq);
        float *cs = alloc(4 * B * D), *sn = alloc(4 * B * D), *o1 = alloc(4 * B * H * D), *o2 = alloc(4 * B * H * D);
        float *qc = alloc(4 * B * H * D);
        fill(kc, NB * s_blk, 1.f);
        fill(vc, NB * s_blk, 1.f);
        memcpy(kc2, kc, es * NB * s_blk);
        memcpy(vc2, vc, es * NB * s_blk);
        fill(qkv, B * nq, 1.f);
        memcpy(qkv2, qkv, 4 * B * nq);
        for (int64_t i = 0; i < B * D; ++i) cs[i] = cosf(0.3f * (float)i), sn[i] = sinf(0.3f * (float)i);
        int64_t slots[3];
        for (int64_t b = 0; b < B; ++b) slots[b] = (int64_t)tables[b * tw + (lens[b] - 1) / bs] * bs + (lens[b] - 1) % bs;
        const int rc = lmi_decode_fused(qkv, qkv + H * D, qkv + (H + Hkv) * D, nq, nq, nq, cs, sn, D, 0, kc, vc, s_blk,
                                        s_tok, s_head, slots, NB * bs, tables, tw, lens, B, H, Hkv, D, bs, 0.125f, 0,
                                        0.f, o1, 2);
        lmi_rotary(qkv2, qkv2 + H * D, cs, sn, B, H, Hkv, D, nq, nq, D, 0, 2);
        lmi_write_kv(kc2, vc2, qkv2 + H * D, qkv2 + (H + Hkv) * D, 4, s_blk, s_tok, s_head, nq, D, nq, D, slots, B, Hkv,
                     D, bs, NB * bs);
        for (int64_t b = 0; b < B; ++b) memcpy(qc + b * H * D, qkv2 + b * nq, 4 * H * D);
        lmi_decode_attention(qc, kc2, vc2, 0, s_blk, s_tok, s_head, tables, tw, lens, B, H, Hkv, D, bs, 0.125f, 0, 0.f,
                             o2, 2);
        ok = ok && rc == 0 && !memcmp(o1, o2, 4 * B * H * D) && !memcmp(kc, kc2, es * NB * s_blk);
        free(kc), free(vc), free(kc2), free(vc2), free(qkv), free(qkv2), free(cs), free(sn), free(o1), free(o2),
            free(qc);
    }
    char detail[160];
    snprintf(detail, sizeof detail, "fp32/bf16 pools, windows: within %.2g of float64; decode_fused = its steps%s",
             worst, ok ? "" : " (FAILED)");
    report("decode_attention", ok && worst < 2e-5, detail);
}

/* Causal attention of whole prompts (the panel GEMMs inside) against float64; bidirectional (an
 * encoder's packed sequences, lmi_encoder_attention) where `causal` is 0. */
static void check_prefill_attention(int bf, const char *name, int causal) {
    const int64_t P = 2, H = 4, Hkv = 2, D = 64, g = H / Hkv, T = 70 + 9;
    const int64_t starts[] = {0, 70}, lens[] = {70, 9}, order[] = {0, 1};
    const int64_t es = bf ? 2 : 4, qs = H * D, ks = Hkv * D;
    char *q = alloc(es * T * qs), *k = alloc(es * T * ks), *v = alloc(es * T * ks), *out = alloc(es * T * qs);
    float *qf = alloc(4 * T * qs), *kf = alloc(4 * T * ks), *vf = alloc(4 * T * ks);
    for (int64_t i = 0; i < T * qs; ++i) qf[i] = frand();
    for (int64_t i = 0; i < T * ks; ++i) kf[i] = frand(), vf[i] = frand();
    for (int64_t i = 0; i < T * qs; ++i) {
        if (bf) ((uint16_t *)q)[i] = f32_to_bf16(qf[i]), qf[i] = bf16_to_f32(((uint16_t *)q)[i]);
        else ((float *)q)[i] = qf[i];
    }
    for (int64_t i = 0; i < T * ks; ++i) {
        if (bf) {
            ((uint16_t *)k)[i] = f32_to_bf16(kf[i]), kf[i] = bf16_to_f32(((uint16_t *)k)[i]);
            ((uint16_t *)v)[i] = f32_to_bf16(vf[i]), vf[i] = bf16_to_f32(((uint16_t *)v)[i]);
        } else {
            ((float *)k)[i] = kf[i], ((float *)v)[i] = vf[i];
        }
    }
    const float scale = 0.125f;
    int ok = (causal ? lmi_prefill_attention(q, k, v, qs, ks, ks, D, D, D, out, qs, D, bf, starts, lens, order, P, H,
                                             Hkv, D, scale, NULL, 2)
                     : lmi_encoder_attention(q, k, v, qs, ks, ks, D, D, D, out, qs, D, bf, starts, lens, order, P, H,
                                             Hkv, D, scale, 2)) == 0;
    double worst = 0;
    for (int64_t p = 0; p < P; ++p)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < lens[p]; ++i) {
                const int64_t row = starts[p] + i, kh = h / g;
                double s[80], m = -1e300, sum = 0, o[64] = {0};
                const int64_t seen = causal ? i + 1 : lens[p];
                for (int64_t t = 0; t < seen; ++t) {
                    double d = 0;
                    for (int64_t e = 0; e < D; ++e) d += (double)qf[row * qs + h * D + e] * kf[(starts[p] + t) * ks + kh * D + e];
                    s[t] = d * scale;
                    m = s[t] > m ? s[t] : m;
                }
                for (int64_t t = 0; t < seen; ++t) sum += (s[t] = exp(s[t] - m));
                for (int64_t t = 0; t < seen; ++t)
                    for (int64_t e = 0; e < D; ++e) o[e] += s[t] / sum * vf[(starts[p] + t) * ks + kh * D + e];
                for (int64_t e = 0; e < D; ++e) {
                    const double got = bf ? bf16_to_f32(((uint16_t *)out)[row * qs + h * D + e]) : ((float *)out)[row * qs + h * D + e];
                    const double err = fabs(got - o[e]) / (bf ? fabs(o[e]) * 0x1p-8 + 0x1p-12 : 1.0);
                    worst = err > worst ? err : worst;
                }
            }
    char detail[160];
    snprintf(detail, sizeof detail, bf ? "bf16: within %.2f of one bf16 rounding of float64"
                                       : "fp32: within %.2g of float64", worst);
    report(name, ok && worst < (bf ? 2.0 : 2e-5), detail);
    free(q), free(k), free(v), free(out), free(qf), free(kf), free(vf);
}

/* ---------------------------------------------------------------- the layer stack */
/* lmi_step_layers on one fp32 layer of 3 decode rows and 2 prompts against the same step composed
 * from the kernels one by one (norm, GEMMs, decode_fused, rotary, write_kv, prefill attention,
 * residual, silu * up): the same bits, as the Python layer's values are the stack's. */
/* lmi_lin, lmi_layer, the LIN_* kinds and lmi_step_layers: kernels/cpu_api.h */
typedef lmi_layer layer_t;

static float *packed(const float *W, int64_t N, int64_t K) {
    float *p = alloc(4 * ((N + 31) / 32) * 32 * K);
    lmi_pack_b(W, N, K, p);
    return p;
}

static void check_stack(void) {
    const int64_t E = 64, H = 4, Hkv = 2, D = 16, I = 96, B = 3, bs = 4, NB = 32, tw = 8;
    const int64_t P = 2, plen[] = {6, 5}, T = B + 6 + 5, nq = (H + 2 * Hkv) * D;
    const int64_t s_tok = Hkv * D, s_blk = bs * s_tok, s_head = D;
    const float eps = 1e-5f, scale = 0.25f;
    float *Wqkv = alloc(4 * nq * E), *Wo = alloc(4 * E * H * D), *Wgu = alloc(4 * 2 * I * E), *Wd = alloc(4 * E * I);
    float *bqkv = alloc(4 * nq), *n1 = alloc(4 * E), *n2 = alloc(4 * E);
    fill(Wqkv, nq * E, 0.2f), fill(Wo, E * H * D, 0.2f), fill(Wgu, 2 * I * E, 0.2f), fill(Wd, E * I, 0.2f);
    fill(bqkv, nq, 0.1f);
    for (int64_t i = 0; i < E; ++i) n1[i] = 1.f + 0.1f * frand(), n2[i] = 1.f + 0.1f * frand();
    float *Pqkv = packed(Wqkv, nq, E), *Po = packed(Wo, E, H * D), *Pgu = packed(Wgu, 2 * I, E), *Pd = packed(Wd, E, I);
    float *kc = alloc(4 * NB * s_blk), *vc = alloc(4 * NB * s_blk), *kc2 = alloc(4 * NB * s_blk), *vc2 = alloc(4 * NB * s_blk);
    fill(kc, NB * s_blk, 1.f), fill(vc, NB * s_blk, 1.f);
    memcpy(kc2, kc, 4 * NB * s_blk), memcpy(vc2, vc, 4 * NB * s_blk);
    layer_t ly = {{LIN_F32, nq, E, Pqkv, 0, 0, bqkv}, {LIN_F32, 0, E, 0, 0, 0, 0}, {LIN_F32, 0, E, 0, 0, 0, 0},
                  {LIN_F32, E, H * D, Po, 0, 0, 0}, {LIN_F32, 2 * I, E, Pgu, 0, 0, 0}, {LIN_F32, 0, E, 0, 0, 0, 0},
                  {LIN_F32, E, I, Pd, 0, 0, 0}, n1, n2, kc, vc, 0};
    int32_t tables[3 * 8], lens[3] = {5, 9, 2};
    for (int64_t i = 0; i < B * tw; ++i) tables[i] = (int32_t)i;   /* blocks 0..23 for the decode rows */
    int64_t slots[14];
    for (int64_t b = 0; b < B; ++b) slots[b] = (int64_t)tables[b * tw + (lens[b] - 1) / bs] * bs + (lens[b] - 1) % bs;
    for (int64_t t = B; t < T; ++t) slots[t] = 24 * bs + (t - B);      /* the prompts' rows: blocks 24.. */
    const int64_t pst[] = {B, B + plen[0]}, pord[] = {0, 1};
    float *cs = alloc(4 * T * D), *sn = alloc(4 * T * D), *h = alloc(4 * T * E), *h2 = alloc(4 * T * E);
    for (int64_t i = 0; i < T * D; ++i) cs[i] = cosf(0.2f * (float)i), sn[i] = sinf(0.2f * (float)i);
    fill(h, T * E, 1.f);
    memcpy(h2, h, 4 * T * E);
    lmi_set_sleef_expf((void *)plain_expf_v, PLAIN_LANES);
    const int rc = lmi_step_layers(&ly, 1, h, T, B, E, H, Hkv, D, I, eps, 8, 0, cs, sn, D, slots, NB * bs, tables, tw,
                                   lens, P, pst, plen, pord, NULL, NULL, 0, s_blk, s_tok, s_head, bs, scale, 2);
    /* the same step one kernel at a time */
    float *x = alloc(4 * T * E), *qkv = alloc(4 * T * nq), *att = alloc(4 * T * H * D), *o = alloc(4 * T * E);
    float *gu = alloc(4 * T * 2 * I), *act = alloc(4 * T * I), *sq = alloc(4 * E), *qd = alloc(4 * B * H * D);
    lmi_rms_norm_f32(h2, n1, x, T, E, eps, 8, sq);
    lmi_gemm(x, T, E, E, Pqkv, nq, bqkv, qkv, nq, 2);
    int rc2 = lmi_decode_fused(qkv, qkv + H * D, qkv + (H + Hkv) * D, nq, nq, nq, cs, sn, D, 0, kc2, vc2, s_blk, s_tok,
                               s_head, slots, NB * bs, tables, tw, lens, B, H, Hkv, D, bs, scale, 0, 0.f, att, 2);
    (void)qd;
    lmi_rotary(qkv + B * nq, qkv + B * nq + H * D, cs + B * D, sn + B * D, T - B, H, Hkv, D, nq, nq, D, 0, 2);
    lmi_write_kv(kc2, vc2, qkv + B * nq + H * D, qkv + B * nq + (H + Hkv) * D, 4, s_blk, s_tok, s_head, nq, D, nq, D,
                 slots + B, T - B, Hkv, D, bs, NB * bs);
    rc2 |= lmi_prefill_attention(qkv, qkv + H * D, qkv + (H + Hkv) * D, nq, nq, nq, D, D, D, att, H * D, D, 0, pst,
                                 plen, pord, P, H, Hkv, D, scale, NULL, 2);
    lmi_gemm(att, T, H * D, H * D, Po, E, 0, o, E, 2);
    for (int64_t i = 0; i < T * E; ++i) h2[i] += o[i];
    lmi_rms_norm_f32(h2, n2, x, T, E, eps, 8, sq);
    lmi_gemm(x, T, E, E, Pgu, 2 * I, 0, gu, 2 * I, 2);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < I; ++i) {
            const float gg = gu[t * 2 * I + i];
            act[t * I + i] = gg / (1.f + expf(-gg)) * gu[t * 2 * I + I + i];
        }
    lmi_gemm(act, T, I, I, Pd, E, 0, o, E, 2);
    for (int64_t i = 0; i < T * E; ++i) h2[i] += o[i];
    const int ok = rc == 0 && rc2 == 0 && !memcmp(h, h2, 4 * T * E) && !memcmp(kc, kc2, 4 * NB * s_blk) &&
                   !memcmp(vc, vc2, 4 * NB * s_blk);
    report("step_layers", ok, ok ? "fp32, 3 decode rows + 2 prompts: bit-equal to the kernels one by one"
                                 : "differs from the kernels one by one");
}

/* bf16 decode rows (weights bf16, widened in registers: LIN_BF16W) through lmi_step_layers against
 * the same step one kernel at a time, each op rounded to bf16 as the Python layer rounds it. */
static uint16_t *bf16_of(const float *x, int64_t n) {
    uint16_t *o = alloc(2 * n);
    for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(x[i]);
    return o;
}
static uint16_t *packed_bf16(const uint16_t *W, int64_t N, int64_t K) {
    uint16_t *p = alloc(2 * ((N + 31) / 32) * 32 * ((K + 1) / 2) * 2);
    lmi_pack_bf16(W, N, K, p);
    return p;
}
static void linear_bf16w(const uint16_t *x, int64_t m, int64_t k, const uint16_t *P, int64_t n, const float *bias,
                         uint16_t *y) {
    float *xf = alloc(4 * m * k);
    for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_f32(x[i]);
    lmi_gemm_bf16w(xf, m, k, k, P, n, bias, y, n, 1, 2);
    free(xf);
}

static void check_stack_bf16(void) {
    const int64_t E = 64, H = 4, Hkv = 2, D = 16, I = 96, B = 3, bs = 4, NB = 24, tw = 8, nq = (H + 2 * Hkv) * D;
    const int64_t s_tok = Hkv * D, s_blk = bs * s_tok, s_head = D;
    const float eps = 1e-5f, scale = 0.25f;
    float *tmp = alloc(4 * 2 * I * E);
    fill(tmp, nq * E, 0.2f);
    uint16_t *Pqkv = packed_bf16(bf16_of(tmp, nq * E), nq, E);
    fill(tmp, E * H * D, 0.2f);
    uint16_t *Po = packed_bf16(bf16_of(tmp, E * H * D), E, H * D);
    fill(tmp, 2 * I * E, 0.2f);
    uint16_t *Pgu = packed_bf16(bf16_of(tmp, 2 * I * E), 2 * I, E);
    fill(tmp, E * I, 0.2f);
    uint16_t *Pd = packed_bf16(bf16_of(tmp, E * I), E, I);
    float *bqkv = alloc(4 * nq);
    fill(bqkv, nq, 0.1f);
    for (int64_t i = 0; i < 2 * E; ++i) tmp[i] = 1.f + 0.1f * frand();
    uint16_t *n1 = bf16_of(tmp, E), *n2 = bf16_of(tmp + E, E);
    fill(tmp, NB * s_blk, 1.f);
    uint16_t *kc = bf16_of(tmp, NB * s_blk), *kc2 = bf16_of(tmp, NB * s_blk);
    fill(tmp, NB * s_blk, 1.f);
    uint16_t *vc = bf16_of(tmp, NB * s_blk), *vc2 = bf16_of(tmp, NB * s_blk);
    layer_t ly = {{LIN_BF16W, nq, E, Pqkv, 0, 0, bqkv}, {LIN_BF16W, 0, E, 0, 0, 0, 0}, {LIN_BF16W, 0, E, 0, 0, 0, 0},
                  {LIN_BF16W, E, H * D, Po, 0, 0, 0}, {LIN_BF16W, 2 * I, E, Pgu, 0, 0, 0},
                  {LIN_BF16W, 0, E, 0, 0, 0, 0}, {LIN_BF16W, E, I, Pd, 0, 0, 0}, n1, n2, kc, vc, 0};
    int32_t tables[3 * 8], lens[3] = {7, 1, 12};
    for (int64_t i = 0; i < B * tw; ++i) tables[i] = (int32_t)((i * 5) % NB);
    int64_t slots[3];
    for (int64_t b = 0; b < B; ++b) slots[b] = (int64_t)tables[b * tw + (lens[b] - 1) / bs] * bs + (lens[b] - 1) % bs;
    for (int64_t i = 0; i < B * D; ++i) tmp[i] = cosf(0.2f * (float)i), tmp[B * D + i] = sinf(0.2f * (float)i);
    uint16_t *cs = bf16_of(tmp, B * D), *sn = bf16_of(tmp + B * D, B * D);
    fill(tmp, B * E, 1.f);
    uint16_t *h = bf16_of(tmp, B * E), *h2 = bf16_of(tmp, B * E);
    const int64_t none[1] = {0};
    lmi_set_sleef_expf((void *)plain_expf_v, PLAIN_LANES);
    const int rc = lmi_step_layers(&ly, 1, h, B, B, E, H, Hkv, D, I, eps, 0, 1, cs, sn, D, slots, NB * bs, tables, tw,
                                   lens, 0, none, none, none, NULL, NULL, 0, s_blk, s_tok, s_head, bs, scale, 2);
    uint16_t *x = alloc(2 * B * E), *qkv = alloc(2 * B * nq), *att = alloc(2 * B * H * D), *o = alloc(2 * B * E);
    uint16_t *gu = alloc(2 * B * 2 * I), *act = alloc(2 * B * I);
    lmi_rms_norm_bf16(h2, n1, x, B, E, eps, 2);
    linear_bf16w(x, B, E, Pqkv, nq, bqkv, qkv);
    const int rc2 = lmi_decode_fused(qkv, qkv + H * D, qkv + (H + Hkv) * D, nq, nq, nq, cs, sn, D, 1, kc2, vc2, s_blk,
                                     s_tok, s_head, slots, NB * bs, tables, tw, lens, B, H, Hkv, D, bs, scale, 0, 0.f,
                                     att, 2);
    linear_bf16w(att, B, H * D, Po, E, 0, o);
    for (int64_t i = 0; i < B * E; ++i) h2[i] = f32_to_bf16(bf16_to_f32(h2[i]) + bf16_to_f32(o[i]));
    lmi_rms_norm_bf16(h2, n2, x, B, E, eps, 2);
    linear_bf16w(x, B, E, Pgu, 2 * I, 0, gu);
    for (int64_t t = 0; t < B; ++t)
        for (int64_t i = 0; i < I; ++i) {
            const float g = bf16_to_f32(gu[t * 2 * I + i]);
            const float sg = bf16_to_f32(f32_to_bf16(g / (1.f + expf(-g))));
            act[t * I + i] = f32_to_bf16(sg * bf16_to_f32(gu[t * 2 * I + I + i]));
        }
    linear_bf16w(act, B, I, Pd, E, 0, o);
    for (int64_t i = 0; i < B * E; ++i) h2[i] = f32_to_bf16(bf16_to_f32(h2[i]) + bf16_to_f32(o[i]));
    const int ok = rc == 0 && rc2 == 0 && !memcmp(h, h2, 2 * B * E) && !memcmp(kc, kc2, 2 * NB * s_blk) &&
                   !memcmp(vc, vc2, 2 * NB * s_blk);
    report("step_layers_bf16", ok, ok ? "bf16 (weights widened), 3 decode rows: bit-equal to the kernels one by one"
                                      : "differs from the kernels one by one");
}

/* lmi_moe_experts: 11 rows, top-3 of 6 experts (one idle, one taking most rows), fp32 experts (gate|up
 * fused, LIN_F32) and bf16 experts (gate and up apart, widened: LIN_BF16W), on 2 threads (experts in
 * parallel) and 1 (one after another), against the same rows one expert at a time: gathered, the GEMMs, silu(g) * u, down, out += w * y in ascending expert order
 * (the bf16 product and sum each rounded): the same bits. */
static void check_moe(int bf) {
    enum { X = 6, T = 11, K = 3, E = 64, I = 40 };
    float *tmp = alloc(4 * 2 * I * E);
    float *Pgu[X], *Pd[X];
    uint16_t *Bg[X], *Bu[X], *Bd[X];
    lmi_lin gate[X], up[X], down[X];
    memset(gate, 0, sizeof gate), memset(up, 0, sizeof up), memset(down, 0, sizeof down);
    for (int e = 0; e < X; ++e) {
        fill(tmp, 2 * I * E, 0.2f);
        if (bf) {
            Bg[e] = packed_bf16(bf16_of(tmp, I * E), I, E), Bu[e] = packed_bf16(bf16_of(tmp + I * E, I * E), I, E);
            gate[e] = (lmi_lin){LIN_BF16W, I, E, Bg[e]}, up[e] = (lmi_lin){LIN_BF16W, I, E, Bu[e]};
        } else {
            Pgu[e] = packed(tmp, 2 * I, E);
            gate[e] = (lmi_lin){LIN_F32, 2 * I, E, Pgu[e]}, up[e] = (lmi_lin){LIN_F32, 0, E, 0};
        }
        fill(tmp, E * I, 0.2f);
        if (bf) {
            Bd[e] = packed_bf16(bf16_of(tmp, E * I), E, I);
            down[e] = (lmi_lin){LIN_BF16W, E, I, Bd[e]};
        } else {
            Pd[e] = packed(tmp, E, I);
            down[e] = (lmi_lin){LIN_F32, E, I, Pd[e]};
        }
    }
    int64_t ids[T * K];
    float w[T * K];
    for (int64_t t = 0; t < T; ++t) {   /* expert 4 idle; expert 2 first in most rows; distinct per row */
        const int64_t rest[] = {0, 1, 3, 5};
        ids[t * K] = t % 4 ? 2 : 3;
        for (int64_t j = 1, r = t; j < K; ++j, ++r) {
            while (rest[r % 4] == ids[t * K]) ++r;
            ids[t * K + j] = rest[r % 4];
        }
        for (int64_t j = 0; j < K; ++j)
            w[t * K + j] = bf ? bf16_to_f32(f32_to_bf16(0.2f + 0.3f * frand())) : 0.2f + 0.3f * frand();
    }
    const int64_t es = bf ? 2 : 4;
    fill(tmp, T * E, 1.f);
    void *x = bf ? (void *)bf16_of(tmp, T * E) : (void *)tmp;
    char *out = alloc(es * T * E), *ref = alloc(es * T * E);
    lmi_set_sleef_expf((void *)plain_expf_v, PLAIN_LANES);
    int ok = lmi_moe_experts(gate, up, down, X, x, T, E, K, ids, w, out, bf, 2) == 0;
    /* one expert at a time, its rows slot-major */
    memset(ref, 0, es * T * E);
    char *xs = alloc(es * T * E), *gu = alloc(es * T * 2 * I), *act = alloc(es * T * I), *y = alloc(es * T * E);
    int64_t rows[T * K];
    float ws[T * K];
    for (int64_t e = 0; e < X; ++e) {
        int64_t c = 0;
        for (int64_t j = 0; j < K; ++j)
            for (int64_t t = 0; t < T; ++t)
                if (ids[t * K + j] == e) rows[c] = t, ws[c] = w[t * K + j], ++c;
        if (!c) continue;
        for (int64_t i = 0; i < c; ++i) memcpy(xs + i * E * es, (char *)x + rows[i] * E * es, E * es);
        if (bf) {
            uint16_t *g = (uint16_t *)gu, *u = g + c * I;
            linear_bf16w((uint16_t *)xs, c, E, Bg[e], I, 0, g);
            linear_bf16w((uint16_t *)xs, c, E, Bu[e], I, 0, u);
            for (int64_t i = 0; i < c * I; ++i) {
                const float gg = bf16_to_f32(g[i]);
                const float sg = bf16_to_f32(f32_to_bf16(gg / (1.f + expf(-gg))));
                ((uint16_t *)act)[i] = f32_to_bf16(sg * bf16_to_f32(u[i]));
            }
            linear_bf16w((uint16_t *)act, c, I, Bd[e], E, 0, (uint16_t *)y);
            for (int64_t i = 0; i < c; ++i)
                for (int64_t d = 0; d < E; ++d) {
                    uint16_t *o = (uint16_t *)ref + rows[i] * E + d;
                    const float p = bf16_to_f32(f32_to_bf16(bf16_to_f32(((uint16_t *)y)[i * E + d]) * ws[i]));
                    *o = f32_to_bf16(bf16_to_f32(*o) + p);
                }
        } else {
            float *g = (float *)gu, *a = (float *)act, *yy = (float *)y;
            lmi_gemm((float *)xs, c, E, E, Pgu[e], 2 * I, 0, g, 2 * I, 2);
            for (int64_t i = 0; i < c; ++i)
                for (int64_t n = 0; n < I; ++n) {
                    const float gg = g[i * 2 * I + n];
                    a[i * I + n] = gg / (1.f + expf(-gg)) * g[i * 2 * I + I + n];
                }
            lmi_gemm(a, c, I, I, Pd[e], E, 0, yy, E, 2);
            for (int64_t i = 0; i < c; ++i)
                for (int64_t d = 0; d < E; ++d) ((float *)ref)[rows[i] * E + d] += yy[i * E + d] * ws[i];
        }
    }
    ok = ok && !memcmp(out, ref, es * T * E);
    /* one thread: one expert after another (2 threads took the experts in parallel): the same bits */
    memset(out, 0xff, es * T * E);
    ok = ok && lmi_moe_experts(gate, up, down, X, x, T, E, K, ids, w, out, bf, 1) == 0 && !memcmp(out, ref, es * T * E);
    int64_t bad[T * K];
    memcpy(bad, ids, sizeof bad);
    bad[7] = X;
    ok = ok && lmi_moe_experts(gate, up, down, X, x, T, E, K, bad, w, out, bf, 2) == -1 && !memcmp(out, ref, es * T * E);
    report(bf ? "moe_bf16" : "moe", ok, ok ? (bf ? "bf16 experts (widened), 11 rows top-3 of 6: bit-equal to one expert "
                                                   "at a time" : "fp32 experts, 11 rows top-3 of 6: bit-equal to one "
                                                                 "expert at a time")
                                           : "differs from one expert at a time");
    for (int e = 0; e < X; ++e) {
        if (bf) free(Bg[e]), free(Bu[e]), free(Bd[e]);
        else free(Pgu[e]), free(Pd[e]);
    }
    if (bf) free(x);
    free(tmp), free(out), free(ref), free(xs), free(gu), free(act), free(y);
}

/* int8 KV: lmi_write_kv_i8 against a plain quantizer (the same fp32 operations: the bytes and the
 * scales bit for bit; a negative slot skipped, a slot past the pool refused), then
 * lmi_decode_attention_i8 against float64 over the dequantized rows, and lmi_decode_fused_i8
 * against rotary + lmi_write_kv_i8 + lmi_decode_attention_i8 called one by one (the same bits). */
static void ref_quant_row(const float *x, int64_t D, int8_t *q, float *sc) {
    float m = 0.f;
    for (int64_t d = 0; d < D; ++d) m = fabsf(x[d]) > m ? fabsf(x[d]) : m;
    const float inv = m > 0.f ? 127.f / m : 0.f;
    *sc = m / 127.f;
    for (int64_t d = 0; d < D; ++d) {
        const float y = nearbyintf(x[d] * inv);
        q[d] = (int8_t)(y > 127.f ? 127.f : y < -127.f ? -127.f : y);
    }
}

static void check_kv_int8(void) {
    const int64_t B = 3, H = 8, Hkv = 2, D = 64, bs = 4, NB = 24, tw = 8, g = H / Hkv;
    /* head-major pool: [NB, Hkv, bs, D]; scales [NB, Hkv, bs] at the element offset / D */
    const int64_t s_head = bs * D, s_blk = Hkv * bs * D, s_tok = D, rows = NB * bs * Hkv;
    int8_t *kc = alloc(NB * s_blk), *vc = alloc(NB * s_blk), *kr = alloc(NB * s_blk), *vr = alloc(NB * s_blk);
    float *ks = alloc(4 * rows), *vs = alloc(4 * rows), *ksr = alloc(4 * rows), *vsr = alloc(4 * rows);
    memset(kc, 0, NB * s_blk), memset(vc, 0, NB * s_blk), memset(kr, 0, NB * s_blk), memset(vr, 0, NB * s_blk);
    memset(ks, 0, 4 * rows), memset(vs, 0, 4 * rows), memset(ksr, 0, 4 * rows), memset(vsr, 0, 4 * rows);
    const int64_t T = NB * bs;
    float *key = alloc(4 * T * Hkv * D), *val = alloc(4 * T * Hkv * D);
    fill(key, T * Hkv * D, 3.f);
    fill(val, T * Hkv * D, 1.f);
    int64_t *slots = alloc(8 * T);
    for (int64_t t = 0; t < T; ++t) slots[t] = t == 5 ? -1 : (t * 37) % T;
    int ok = lmi_write_kv_i8(kc, vc, ks, vs, key, val, 0, s_blk, s_tok, s_head, Hkv * D, D, Hkv * D, D, slots, T,
                             Hkv, D, bs, NB * bs) == 0;
    for (int64_t t = 0; t < T; ++t) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t at = (slots[t] / bs) * s_blk + (slots[t] % bs) * s_tok + h * s_head;
            ref_quant_row(key + (t * Hkv + h) * D, D, kr + at, ksr + at / D);
            ref_quant_row(val + (t * Hkv + h) * D, D, vr + at, vsr + at / D);
        }
    }
    ok = ok && !memcmp(kc, kr, NB * s_blk) && !memcmp(vc, vr, NB * s_blk) && !memcmp(ks, ksr, 4 * rows)
         && !memcmp(vs, vsr, 4 * rows);
    const int64_t bad[] = {3, NB * bs};
    ok = ok && lmi_write_kv_i8(kc, vc, ks, vs, key, val, 0, s_blk, s_tok, s_head, Hkv * D, D, Hkv * D, D, bad, 2, Hkv,
                               D, bs, NB * bs) == -1 && !memcmp(kc, kr, NB * s_blk);
    const int32_t lens[] = {1, 13, 29};
    int32_t tables[3 * 8];
    for (int64_t i = 0; i < B * tw; ++i) tables[i] = (int32_t)((i * 7 + 3) % NB);
    float *q = alloc(4 * B * H * D), *out = alloc(4 * B * H * D);
    fill(q, B * H * D, 1.f);
    double worst = 0;
    for (int64_t window = 0; window <= 5; window += 5) {
        ok = ok && lmi_decode_attention_i8(q, kc, vc, ks, vs, s_blk, s_tok, s_head, tables, tw, lens, B, H, Hkv, D, bs,
                                           0.125f, window, 0.f, out, 2) == 0;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < H; ++h) {
                const int64_t kh = h / g, L = lens[b], t0 = window && L > window ? L - window : 0;
                double s[64], m = -1e300, sum = 0, o[64] = {0};
                for (int64_t t = t0; t < L; ++t) {
                    const int64_t at = (int64_t)tables[b * tw + t / bs] * s_blk + (t % bs) * s_tok + kh * s_head;
                    double d = 0;
                    for (int64_t i = 0; i < D; ++i) d += (double)q[(b * H + h) * D + i] * kc[at + i] * ks[at / D];
                    s[t] = d * 0.125;
                    m = s[t] > m ? s[t] : m;
                }
                for (int64_t t = t0; t < L; ++t) sum += (s[t] = exp(s[t] - m));
                for (int64_t t = t0; t < L; ++t) {
                    const int64_t at = (int64_t)tables[b * tw + t / bs] * s_blk + (t % bs) * s_tok + kh * s_head;
                    for (int64_t i = 0; i < D; ++i) o[i] += s[t] / sum * (double)vc[at + i] * vs[at / D];
                }
                for (int64_t i = 0; i < D; ++i) {
                    const double e = fabs(out[(b * H + h) * D + i] - o[i]);
                    worst = e > worst ? e : worst;
                }
            }
    }
    /* the fused step (fp32 activations): one row per sequence at position lens[b] - 1 */
    const int64_t nq = (H + 2 * Hkv) * D;
    float *qkv = alloc(4 * B * nq), *qkv2 = alloc(4 * B * nq), *cs = alloc(4 * B * D), *sn = alloc(4 * B * D);
    float *o1 = alloc(4 * B * H * D), *o2 = alloc(4 * B * H * D);
    fill(qkv, B * nq, 1.f);
    fill(cs, B * D, 1.f);
    fill(sn, B * D, 1.f);
    memcpy(qkv2, qkv, 4 * B * nq);
    int64_t dslots[3];
    for (int64_t b = 0; b < B; ++b) dslots[b] = (int64_t)tables[b * tw + (lens[b] - 1) / bs] * bs + (lens[b] - 1) % bs;
    int8_t *kc2 = alloc(NB * s_blk), *vc2 = alloc(NB * s_blk);
    float *ks2 = alloc(4 * rows), *vs2 = alloc(4 * rows);
    memcpy(kc2, kc, NB * s_blk), memcpy(vc2, vc, NB * s_blk), memcpy(ks2, ks, 4 * rows), memcpy(vs2, vs, 4 * rows);
    ok = ok && lmi_decode_fused_i8(qkv, qkv + H * D, qkv + (H + Hkv) * D, nq, nq, nq, cs, sn, D, 0, kc, vc, ks, vs,
                                   s_blk, s_tok, s_head, dslots, NB * bs, tables, tw, lens, B, H, Hkv, D, bs, 0.125f, 0,
                                   0.f, o1, 2) == 0;
    lmi_rotary(qkv2, qkv2 + H * D, cs, sn, B, H, Hkv, D, nq, nq, D, 0, 1);
    lmi_write_kv_i8(kc2, vc2, ks2, vs2, qkv2 + H * D, qkv2 + (H + Hkv) * D, 0, s_blk, s_tok, s_head, nq, D, nq, D,
                    dslots, B, Hkv, D, bs, NB * bs);
    float *qc = alloc(4 * B * H * D);
    for (int64_t b = 0; b < B; ++b) memcpy(qc + b * H * D, qkv2 + b * nq, 4 * H * D);
    lmi_decode_attention_i8(qc, kc2, vc2, ks2, vs2, s_blk, s_tok, s_head, tables, tw, lens, B, H, Hkv, D, bs, 0.125f,
                            0, 0.f, o2, 2);
    ok = ok && !memcmp(o1, o2, 4 * B * H * D) && !memcmp(kc, kc2, NB * s_blk) && !memcmp(ks, ks2, 4 * rows);
    char detail[160];
    snprintf(detail, sizeof detail, "write = plain quantizer bit for bit; attention max |err| %.2e vs float64 over "
             "the dequantized rows; fused = one by one", worst);
    report("kv_int8", ok && worst < 2e-5, detail);
    free(kc), free(vc), free(kr), free(vr), free(ks), free(vs), free(ksr), free(vsr), free(key), free(val);
    free(slots), free(q), free(out), free(qkv), free(qkv2), free(cs), free(sn), free(o1), free(o2), free(kc2);
    free(vc2), free(ks2), free(vs2), free(qc);
}

int main(void) {
    const int gemm = lmi_gemm_available(), bf16w = lmi_gemm_bf16w_available(), bf16 = lmi_gemm_bf16_available();
    const int i8 = lmi_gemm_i8_available(), q = lmi_gemm_q_available(), silu = lmi_silu_lanes() > 0;
    printf("AVAIL gemm %d\nAVAIL gemm_bf16w %d\nAVAIL gemm_bf16 %d\nAVAIL gemm_i8 %d\nAVAIL gemm_q %d\n", gemm, bf16w,
           bf16, i8, q);
    printf("AVAIL silu %d\nAVAIL prefill_attention_fp32 %d\nAVAIL prefill_attention_bf16 %d\nAVAIL step_layers %d\n",
           silu, gemm, bf16 && bf16w, gemm && silu);
    printf("AVAIL step_layers_bf16 %d\nAVAIL moe %d\nAVAIL moe_bf16 %d\n", bf16w && silu, gemm && silu, bf16w && silu);
    printf("AVAIL encoder_attention_fp32 %d\nAVAIL encoder_attention_bf16 %d\n", gemm, bf16 && bf16w);
    /* portable C: always built */
    printf("AVAIL rotary 1\nAVAIL write_kv 1\nAVAIL rms_norm 1\nAVAIL row_stats 1\nAVAIL decode_attention 1\n");
    printf("AVAIL kv_int8 1\n");
    fflush(stdout);
    check_rotary();
    check_write_kv();
    check_rms_norms();
    check_row_stats();
    check_decode_attention();
    check_kv_int8();
    if (gemm) check_gemm();
    if (bf16w) check_gemm_bf16w();
    if (bf16) check_gemm_bf16();
    if (i8) check_gemm_i8();
    if (q) check_gemm_q();
    if (silu) check_silu();
    if (gemm) check_prefill_attention(0, "prefill_attention_fp32", 1);
    if (bf16 && bf16w) check_prefill_attention(1, "prefill_attention_bf16", 1);
    if (gemm) check_prefill_attention(0, "encoder_attention_fp32", 0);
    if (bf16 && bf16w) check_prefill_attention(1, "encoder_attention_bf16", 0);
    if (gemm && silu) check_stack();
    if (bf16w && silu) check_stack_bf16();
    if (gemm && silu) check_moe(0);
    if (bf16w && silu) check_moe(1);
    printf("DONE %d failed\n", failures);
    return failures ? 1 : 0;
}
