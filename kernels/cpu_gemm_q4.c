/* Grouped low-bit weight GEMM for CPU linear layers (AWQ, GPTQ, GGUF's blocks, W8A16):
 * C[M, N] = A[M, K] @ W^T (+ bias), fp32 activations, with
 *
 *   W[n, k] = q[n, k] * S[n, k / g] + Mn[n, k / g]        q of 4, 5, 6 or 8 bits
 *
 * one scale and one offset ("min", = -zero * scale for AWQ/GPTQ) per output channel n and group
 * of g consecutive k (handler/model/quant_int4.py maps every format to this one).
 *
 * Layout (packed in handler/model/quant_int4.py): panels of 32 output columns as in
 * kernels/cpu_gemm.c, [ceil(N/32)][K][RB] bytes, RB bytes a row k:
 *   4-bit (RB 16): byte j holds column j in its low nibble and column j + 16 in its high nibble;
 *   5/6-bit (RB 20/24): those 16 bytes (the codes' low 4 bits), then one 32-bit plane per higher
 *     bit (bit 4, then bit 5), bit j of a plane (little endian) belonging to column j;
 *   8-bit (RB 32): byte j, column j.
 * Scales and mins (smode), G = ceil(K/g) groups, zero padded:
 *   QS_F32: S, Mn fp32 [ceil(N/32)][G][32];
 *   QS_F16: S, Mn fp16 [ceil(N/32)][G][32] (formats whose scale and min fp16 holds exactly: GGUF's
 *     32-blocks, whose d is fp16 and min -8d / -16d / -128d or an fp16 m);
 *   QS_I8: two levels, as GGUF's K-quants store them: S, Mn int8 [ceil(N/32)][G][32] sub-scales
 *     times D, E fp32 [ceil(N/32)][ceil(G/sg)][32], one per sg groups (a 256-input superblock):
 *     s = D * S, m = E * Mn (an fp16 d times a 6/8-bit integer: exact in fp32).
 * Every mode yields the same fp32 s and m for a group, so the same weights bit for bit; the compact
 * ones only stream fewer bytes (Q4_K: 4.75 bits a weight against 6 with fp32 scales and mins;
 * Q6_K: 6.75 against 12 with byte codes and fp32 scales).
 *
 * Microkernel: up to 12 rows x 32 columns of fp32 accumulators in 24 zmm registers; for each k,
 * one 16-byte load widened to 16 int32 lanes, the two nibbles split by a mask and a shift (5/6-bit:
 * each plane's bits ORed in under a mask register), converted to fp32 and dequantized by one FMA
 * each with the group's scale/min (held in registers for the group), then two FMAs per row. The
 * dequantized weight is fma(q, s, m), exact for every format served (q * s has at most 8 + 11 + 8
 * significant bits, and q * s + m is the format's weight rounded once, as numpy's / torch's
 * dequantization rounds it), and each output is summed in k order by FMAs from 0, then + bias: the
 * same operations, in the same order, as kernels/cpu_gemm.c on the dequantized fp32 weights. So a
 * quantized model computes bit for bit what its dequantized fp32 model computes on this path.
 * A row's result depends only on that row.
 *
 * A decode step streams every weight once, so its time is the code and scale bytes; the
 * dequantization costs about 8-14 instructions per k per 32 columns, shared by the row block. Past
 * one row block (M > 12) each panel is instead dequantized once into a per-thread fp32 buffer
 * (K x 32, in L2) and every row block runs kernels/cpu_gemm.c's fp32 microkernel over it (the same
 * values, the same order), so compute-bound prefill steps pay one dequantization per panel.
 *
 * Builds (kernels/isa.py): avx512 as above; AVX2+FMA(+F16C) and aarch64 NEON over 8-lane vectors
 * (register kernel up to 2 rows, dequantized panels past that), the same values bit for bit. The
 * opt-in int8-activation products (HAVE_Q_A8): avx512 with VNNI and VBMI, and avx2, the same values.
 * Elsewhere lmi_gemm_q_available() returns 0 and the caller dequantizes in torch instead.
 */
#include <stdint.h>
#include <string.h>

#include <stdlib.h>

#include <omp.h>

#include "cpu_api.h"
#include "cpu_arch.h"
#include "cpu_panel.h"

#define NR 32
#define MRMAX 12

/* bytes of one packed row k of a panel */
#define ROW_BYTES(BITS) ((BITS) == 8 ? 32 : 16 + 4 * ((BITS) - 4))

/* One panel's scale source (see the top). */
typedef struct {
    int mode;
    const uint8_t *s, *m;
    const float *d, *e;
    int64_t sg;
} qsrc;

static inline qsrc qsrc_panel(int mode, const void *S, const void *Mn, const float *D, const float *E, int64_t sg,
                              int64_t G, int64_t p) {
    const int64_t es = mode == QS_F32 ? 4 : mode == QS_F16 ? 2 : 1;
    const int64_t GS = mode == QS_I8 ? (G + sg - 1) / sg : 0;
    qsrc c = {mode, (const uint8_t *)S + p * G * NR * es, (const uint8_t *)Mn + p * G * NR * es,
              mode == QS_I8 ? D + p * GS * NR : 0, mode == QS_I8 ? E + p * GS * NR : 0, sg > 0 ? sg : 1};
    return c;
}

/* The cache-line step of the codes stream: true for the one row k of each 64-byte line that starts
 * in the line's first RB bytes (every line holds at least two rows' starts for RB <= 32). */
#define LINE_START(k, RB) ((((k) * (RB)) & 63) < (RB))

/* An int8-activation kernel (HAVE_Q_A8 below): MR rows' quantized activations aq (row stride K), their
 * per-group da, sa and integer sums si (stride G) x one panel -> C; Bn: the next panel's codes or NULL. */
typedef void (*ka8_t)(const int8_t *aq, const float *da, const float *sa, const int32_t *si, int64_t G,
                      const uint8_t *B, int64_t K, int64_t g, const qsrc *c, float *C, int64_t ldc,
                      const float *bias, int64_t ncols, const uint8_t *Bn);

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

int lmi_gemm_q_available(void) { return 1; }

/* The first n of 16 lanes (none for n <= 0, all for n >= 16): a panel's partial columns, a group's tail. */
static inline __mmask16 lanes16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* Group gi's 32 scales (s0: columns 0-15, s1: 16-31) and mins (n0, n1), in registers. */
static inline void qs_group(const qsrc *c, int64_t gi, __m512 *s0, __m512 *s1, __m512 *n0, __m512 *n1) {
    if (c->mode == QS_F32) {
        const float *s = (const float *)c->s + gi * NR, *m = (const float *)c->m + gi * NR;
        *s0 = _mm512_loadu_ps(s), *s1 = _mm512_loadu_ps(s + 16);
        *n0 = _mm512_loadu_ps(m), *n1 = _mm512_loadu_ps(m + 16);
    } else if (c->mode == QS_F16) {
        const uint16_t *s = (const uint16_t *)c->s + gi * NR, *m = (const uint16_t *)c->m + gi * NR;
        *s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
        *s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16)));
        *n0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m));
        *n1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 16)));
    } else {
        const int8_t *a = (const int8_t *)c->s + gi * NR, *b = (const int8_t *)c->m + gi * NR;
        const float *d = c->d + gi / c->sg * NR, *e = c->e + gi / c->sg * NR;
        const __m512 a0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)a)));
        const __m512 a1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a + 16))));
        const __m512 b0 = a == b ? a0 : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)));
        const __m512 b1 = a == b ? a1
                                 : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16))));
        *s0 = _mm512_mul_ps(_mm512_loadu_ps(d), a0), *s1 = _mm512_mul_ps(_mm512_loadu_ps(d + 16), a1);
        *n0 = _mm512_mul_ps(_mm512_loadu_ps(e), b0), *n1 = _mm512_mul_ps(_mm512_loadu_ps(e + 16), b1);
    }
}

/* Row k's codes (b: its RB bytes) -> columns 0-15 (*q0) and 16-31 (*q1) as int32 lanes. */
static inline void q_codes(const uint8_t *b, int bits, __m512i *q0, __m512i *q1) {
    if (bits == 8) {
        *q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        *q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
        return;
    }
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(q, 4);
    for (int p = 0; p < bits - 4; ++p) {
        uint32_t w;
        memcpy(&w, b + 16 + 4 * p, 4);
        const __m512i bit = _mm512_set1_epi32(16 << p);
        lo = _mm512_mask_or_epi32(lo, (__mmask16)w, lo, bit);
        hi = _mm512_mask_or_epi32(hi, (__mmask16)(w >> 16), hi, bit);
    }
    *q0 = lo, *q1 = hi;
}

/* MR rows of A x one panel (B: its packed codes, c: its scales and mins) -> C.
 * Bn (or NULL): the next panel's codes, Bn_lines cache lines long; row block pf0 of pfs prefetches
 * every pfs-th cache line of it into L2 so the panel's row blocks share the prefetching. */
#define KERNEL(BITS, MR)                                                                              \
    static void kq##BITS##_##MR(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g, \
                                const qsrc *c, float *C, int64_t ldc,                                 \
                                const float *bias, int64_t ncols, const uint8_t *Bn,                  \
                                int64_t Bn_lines, int64_t pf0, int64_t pfs) {                        \
        const int64_t RB = ROW_BYTES(BITS);                                                           \
        __m512 c0[MR], c1[MR];                                                                        \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            c0[r] = _mm512_setzero_ps();                                                              \
            c1[r] = _mm512_setzero_ps();                                                              \
        }                                                                                             \
        int64_t pfl = Bn ? pf0 : Bn_lines;                                                            \
        for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {                                         \
            __m512 s0, s1, n0, n1;                                                                    \
            qs_group(c, gi, &s0, &s1, &n0, &n1);                                                      \
            const int64_t k1 = k0 + g < K ? k0 + g : K;                                               \
            for (int64_t k = k0; k < k1; ++k) {                                                       \
                const uint8_t *b = B + k * RB;                                                        \
                if (LINE_START(k, RB)) {                                                              \
                    const int64_t line = k * RB >> 6;                                                 \
                    if (line == pfl) {                                                                \
                        _mm_prefetch((const char *)(Bn + line * 64), _MM_HINT_T1);                    \
                        pfl += pfs;                                                                   \
                    }                                                                                 \
                    _mm_prefetch((const char *)(b + 512), _MM_HINT_T0);                               \
                }                                                                                     \
                __m512i q0, q1;                                                                       \
                q_codes(b, BITS, &q0, &q1);                                                           \
                const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, n0);                    \
                const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, n1);                    \
                UNROLL_MR for (int r = 0; r < MR; ++r) {                                              \
                    const __m512 a = _mm512_set1_ps(A[r * lda + k]);                                  \
                    c0[r] = _mm512_fmadd_ps(a, w0, c0[r]);                                            \
                    c1[r] = _mm512_fmadd_ps(a, w1, c1[r]);                                            \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        const __mmask16 m0 = lanes16(ncols), m1 = lanes16(ncols - 16);                                \
        if (bias) {                                                                                   \
            const __m512 bb0 = _mm512_maskz_loadu_ps(m0, bias), bb1 = _mm512_maskz_loadu_ps(m1, bias + 16); \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                        \
                c0[r] = _mm512_add_ps(c0[r], bb0);                                                    \
                c1[r] = _mm512_add_ps(c1[r], bb1);                                                    \
            }                                                                                         \
        }                                                                                             \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            _mm512_mask_storeu_ps(C + r * ldc, m0, c0[r]);                                            \
            _mm512_mask_storeu_ps(C + r * ldc + 16, m1, c1[r]);                                       \
        }                                                                                             \
    }
#define KERNELS(BITS) KERNEL(BITS, 1) KERNEL(BITS, 2) KERNEL(BITS, 3) KERNEL(BITS, 4) KERNEL(BITS, 5)      \
    KERNEL(BITS, 6) KERNEL(BITS, 7) KERNEL(BITS, 8) KERNEL(BITS, 9) KERNEL(BITS, 10) KERNEL(BITS, 11)       \
    KERNEL(BITS, 12)
KERNELS(4) KERNELS(5) KERNELS(6) KERNELS(8)


/* One panel's weights dequantized into W [K][32] fp32, exactly as the register kernels compute
 * them (fma(q, s, m)); the next panel's codes (Bn, or NULL) prefetched into L2 meanwhile. */
static void dequant_panel(const uint8_t *B, int64_t K, int64_t g, const qsrc *c, int bits, float *W,
                          const uint8_t *Bn) {
    const int64_t RB = ROW_BYTES(bits);
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
        __m512 s0, s1, n0, n1;
        qs_group(c, gi, &s0, &s1, &n0, &n1);
        const int64_t k1 = k0 + g < K ? k0 + g : K;
        for (int64_t k = k0; k < k1; ++k) {
            const uint8_t *b = B + k * RB;
            if (Bn && LINE_START(k, RB)) _mm_prefetch((const char *)(Bn + k * RB), _MM_HINT_T1);
            __m512i q0, q1;
            q_codes(b, bits, &q0, &q1);
            _mm512_store_ps(W + k * NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, n0));
            _mm512_store_ps(W + k * NR + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, n1));
        }
    }
}

typedef void (*kq_t)(const float *, int64_t, const uint8_t *, int64_t, int64_t, const qsrc *, float *, int64_t,
                     const float *, int64_t, const uint8_t *, int64_t, int64_t, int64_t);
#define KTABLE(BITS) {0, kq##BITS##_1, kq##BITS##_2, kq##BITS##_3, kq##BITS##_4, kq##BITS##_5, kq##BITS##_6, \
                      kq##BITS##_7, kq##BITS##_8, kq##BITS##_9, kq##BITS##_10, kq##BITS##_11, kq##BITS##_12}
static const kq_t KQ[4][MRMAX + 1] = {KTABLE(4), KTABLE(5), KTABLE(6), KTABLE(8)};
#define MRQ MRMAX
#define MRF MRMAX

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* Int8 activations (lmi_gemm_q's act8), for every row count (so a request's tokens do not depend on what
 * it is batched with): each row quantized per group as llama.cpp's Q8 blocks,
 *   aq[k] = round_even(a[k] * 127 / amax_g),  da_g = amax_g / 127,  sa_g = da_g * sum_k aq[k],
 * and each group's codes multiplied by aq with vpdpbusd (4 codes x 4 int8 per lane, exact int32 sums),
 *   y += s * (float(sum_k q aq) * da_g) + m * sa_g        (fp32, per group, in group order)
 * So the codes stream through ~7 vector instructions per 128 weights instead of ~36 for the exact fp32
 * dequantization; the result is not bit for bit the dequantized model's (the activations are rounded
 * to 8 bits per group). Codes of 4 bits (nibbles) and 8 (bytes); 4 rows k..k+3 are transposed into one
 * 4-code dword per column by one vpermb (4-bit: the 64 bytes of the 4 rows; 8-bit: vpermt2b over 128). */
#define HAVE_Q_A8 1

static void a8_row(const float *a, int64_t K, int64_t g, int8_t *aq, float *da, float *sa, int32_t *si) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
        __m512 mx = _mm512_setzero_ps();
        for (int64_t i = 0; i < g; i += 16) {
            const __mmask16 mk = lanes16(g - i);
            mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_maskz_loadu_ps(mk, a + k0 + i), sign));
        }
        const float amax = _mm512_reduce_max_ps(mx), id = amax > 0.f ? 127.f / amax : 0.f;
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < g; i += 16) {
            const __mmask16 mk = lanes16(g - i);
            const __m512i q = _mm512_maskz_cvtps_epi32(mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, a + k0 + i),
                                                                         _mm512_set1_ps(id)));
            _mm512_mask_cvtepi32_storeu_epi8(aq + k0 + i, mk, q);
            sum = _mm512_add_epi32(sum, q);
        }
        si[gi] = _mm512_reduce_add_epi32(sum);
        da[gi] = amax / 127.f;
        sa[gi] = da[gi] * (float)si[gi];
    }
}

/* vpermb indices: output byte 4j + r <- row r's byte j (4-bit: rows of 16 bytes in one zmm; 8-bit: rows
 * of 32 bytes over two zmm, columns j (half 0) or 16 + j (half 1)). */
#define P4(j) 0 + (j), 16 + (j), 32 + (j), 48 + (j)
#define P8(j) 0 + (j), 32 + (j), 64 + (j), 96 + (j)
#define P16(P, o) P(o + 0), P(o + 1), P(o + 2), P(o + 3), P(o + 4), P(o + 5), P(o + 6), P(o + 7), P(o + 8), \
                  P(o + 9), P(o + 10), P(o + 11), P(o + 12), P(o + 13), P(o + 14), P(o + 15)
static const uint8_t A8_PERM[3][64] = {{P16(P4, 0)}, {P16(P8, 0)}, {P16(P8, 16)}};

/* MR rows (their quantized activations aq at row stride K, da / sa at stride G) x one panel -> C. */
#define KA8(BITS, MR)                                                                                 \
    static void ka8_##BITS##_##MR(const int8_t *aq, const float *da, const float *sa, const int32_t *si, \
                                  int64_t G, const uint8_t *B, int64_t K, int64_t g, const qsrc *c,   \
                                  float *C, int64_t ldc, const float *bias, int64_t ncols,            \
                                  const uint8_t *Bn) {                                                \
        (void)si;                                                                                     \
        const int64_t RB = ROW_BYTES(BITS);                                                           \
        const __m512i lo4 = _mm512_set1_epi8(0x0F);                                                   \
        const __m512i p0 = _mm512_loadu_si512(A8_PERM[BITS == 4 ? 0 : 1]), p1 = _mm512_loadu_si512(A8_PERM[2]); \
        __m512 y0[MR], y1[MR];                                                                        \
        UNROLL_MR for (int r = 0; r < MR; ++r) y0[r] = y1[r] = _mm512_setzero_ps();                   \
        for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {                                         \
            __m512i acc0[MR], acc1[MR];                                                               \
            UNROLL_MR for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_si512();        \
            for (int64_t k = k0; k < k0 + g; k += 4) {                                                \
                const uint8_t *b = B + k * RB;                                                        \
                if (Bn) _mm_prefetch((const char *)(Bn + k * RB), _MM_HINT_T1);                       \
                _mm_prefetch((const char *)(b + 1024), _MM_HINT_T0);                                  \
                __m512i w0, w1;                                                                       \
                if (BITS == 4) {                                                                      \
                    const __m512i t = _mm512_permutexvar_epi8(p0, _mm512_loadu_si512(b));             \
                    w0 = _mm512_and_si512(t, lo4);                                                    \
                    w1 = _mm512_and_si512(_mm512_srli_epi16(t, 4), lo4);                              \
                } else {                                                                              \
                    if (Bn) _mm_prefetch((const char *)(Bn + k * RB + 64), _MM_HINT_T1);              \
                    const __m512i z0 = _mm512_loadu_si512(b), z1 = _mm512_loadu_si512(b + 64);       \
                    w0 = _mm512_permutex2var_epi8(z0, p0, z1);                                        \
                    w1 = _mm512_permutex2var_epi8(z0, p1, z1);                                        \
                }                                                                                     \
                UNROLL_MR for (int r = 0; r < MR; ++r) {                                              \
                    int32_t a4;                                                                       \
                    memcpy(&a4, aq + r * K + k, 4);                                                   \
                    const __m512i av = _mm512_set1_epi32(a4);                                         \
                    acc0[r] = _mm512_dpbusd_epi32(acc0[r], w0, av);                                   \
                    acc1[r] = _mm512_dpbusd_epi32(acc1[r], w1, av);                                   \
                }                                                                                     \
            }                                                                                         \
            __m512 s0, s1, n0, n1;                                                                    \
            qs_group(c, gi, &s0, &s1, &n0, &n1);                                                      \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                  \
                const __m512 d = _mm512_set1_ps(da[r * G + gi]), sm = _mm512_set1_ps(sa[r * G + gi]); \
                y0[r] = _mm512_fmadd_ps(n0, sm, _mm512_fmadd_ps(s0, _mm512_mul_ps(_mm512_cvtepi32_ps(acc0[r]), d), y0[r])); \
                y1[r] = _mm512_fmadd_ps(n1, sm, _mm512_fmadd_ps(s1, _mm512_mul_ps(_mm512_cvtepi32_ps(acc1[r]), d), y1[r])); \
            }                                                                                         \
        }                                                                                             \
        const __mmask16 m0 = lanes16(ncols), m1 = lanes16(ncols - 16);                                \
        const __m512 bb0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();              \
        const __m512 bb1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();         \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            _mm512_mask_storeu_ps(C + r * ldc, m0, bias ? _mm512_add_ps(y0[r], bb0) : y0[r]);         \
            _mm512_mask_storeu_ps(C + r * ldc + 16, m1, bias ? _mm512_add_ps(y1[r], bb1) : y1[r]);    \
        }                                                                                             \
    }
#define MRA 6       /* rows a pass: 2 int32 + 2 fp32 accumulators a row in 24 zmm */
#define KA8S(BITS) KA8(BITS, 1) KA8(BITS, 2) KA8(BITS, 3) KA8(BITS, 4) KA8(BITS, 5) KA8(BITS, 6)
KA8S(4) KA8S(8)
static const ka8_t KA8T[2][MRA + 1] = {{0, ka8_4_1, ka8_4_2, ka8_4_3, ka8_4_4, ka8_4_5, ka8_4_6},
                                       {0, ka8_8_1, ka8_8_2, ka8_8_3, ka8_8_4, ka8_8_5, ka8_8_6}};
#endif
#elif (defined(__AVX2__) && defined(__FMA__)) || (defined(__ARM_NEON) && defined(__aarch64__))
/* AVX2+FMA and aarch64 NEON: the same packing, and per output the same operations in the same
 * order (weights fma(q, s, m); FMAs in k order from 0; then + bias), so the AVX-512 build's values
 * bit for bit. Vectors of 8 lanes (one ymm, or two NEON q registers); the 8 codes of a vector are
 * 8 bytes of a k's row: bytes 0-7 hold columns 0-7 (low nibbles) and 16-23 (high), bytes 8-15
 * columns 8-15 and 24-31; byte i of a bit plane holds columns 8i..8i+7. Up to MRQ rows run a whole
 * panel in registers (4 accumulators a row: 4 independent FMA chains, so one row is not held to the
 * FMA latency); past that each panel is dequantized once into W [K][32] fp32 and MRF-row blocks run
 * over it (kernels/cpu_gemm.c's AVX2 block shape, 3 rows x 32 columns, the panel loads folded into
 * the FMAs). On the AVX2 build's 16 ymm registers 3 rows in registers spilled, and the dequantized
 * panel beat them at 3 rows. */
#include <omp.h>

#define MRQ 2
#define MRF 3

int lmi_gemm_q_available(void) { return 1; }

#include "cpu_simd.h"

/* Group gi's scales and mins, 4 vectors each (see the top's modes). */
static inline void qs_group(const qsrc *c, int64_t gi, v8f *s, v8f *m) {
    for (int v = 0; v < 4; ++v) {
        if (c->mode == QS_F32) {
            s[v] = v8f_load((const float *)c->s + gi * NR + 8 * v);
            m[v] = v8f_load((const float *)c->m + gi * NR + 8 * v);
        } else if (c->mode == QS_F16) {
            s[v] = v8f_f16((const uint16_t *)c->s + gi * NR + 8 * v);
            m[v] = v8f_f16((const uint16_t *)c->m + gi * NR + 8 * v);
        } else {
            s[v] = v8f_mul(v8f_load(c->d + gi / c->sg * NR + 8 * v), v8f_i8((const int8_t *)c->s + gi * NR + 8 * v));
            m[v] = v8f_mul(v8f_load(c->e + gi / c->sg * NR + 8 * v), v8f_i8((const int8_t *)c->m + gi * NR + 8 * v));
        }
    }
}

/* MR rows' sums Y[r][v] (columns 8v..8v+7) + bias (or none) -> C, the panel's first ncols columns. */
#define Q_STORE_ROWS(Y, MR)                                                                           \
    UNROLL_MR for (int v = 0; v < 4; ++v) {                                                           \
        const int nn = ncols - 8 * v >= 8 ? 8 : ncols > 8 * v ? (int)(ncols - 8 * v) : 0;             \
        if (bias) {                                                                                   \
            const v8f bb = v8f_load_n(bias + 8 * v, nn);                                                \
            UNROLL_MR for (int r = 0; r < MR; ++r) Y[r][v] = v8f_add(Y[r][v], bb);                     \
        }                                                                                             \
        UNROLL_MR for (int r = 0; r < MR; ++r) v8f_store_n(C + r * ldc + 8 * v, Y[r][v], nn);          \
    }

/* Row k's codes (b: its RB bytes) dequantized: w[v] = fma(q, s[v], m[v]) for columns 8v..8v+7. */
static inline void q_deq(const uint8_t *b, int bits, const v8f *s, const v8f *m, v8f *w) {
    if (bits == 8) {
        for (int v = 0; v < 4; ++v) w[v] = v8f_fma(v8f_u8(b + 8 * v), s[v], m[v]);
        return;
    }
    const int planes = bits - 4;
    w[0] = v8f_fma(v8f_codes(b, 0, b + 16, planes), s[0], m[0]);
    w[1] = v8f_fma(v8f_codes(b + 8, 0, b + 17, planes), s[1], m[1]);
    w[2] = v8f_fma(v8f_codes(b, 4, b + 18, planes), s[2], m[2]);
    w[3] = v8f_fma(v8f_codes(b + 8, 4, b + 19, planes), s[3], m[3]);
}

/* MR rows of A x one panel (B: its codes, c: its scales and mins) -> C. Bn (or NULL): the next
 * panel's codes, Bn_lines cache lines; row block pf0 of pfs prefetches every pfs-th line of it
 * into L2. A whole panel per pass: one row's 4 accumulators are 4 independent FMA chains, so one
 * row is not held to one FMA latency per 16 columns. */
#define KERNEL(BITS, MR)                                                                              \
    static void kq##BITS##_##MR(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g, \
                                const qsrc *c, float *C, int64_t ldc,                                 \
                                const float *bias, int64_t ncols, const uint8_t *Bn,                  \
                                int64_t Bn_lines, int64_t pf0, int64_t pfs) {                        \
        const int64_t RB = ROW_BYTES(BITS);                                                           \
        v8f x[MR][4];                                                                                  \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            UNROLL_MR for (int v = 0; v < 4; ++v) x[r][v] = v8f_zero();                                \
        }                                                                                             \
        int64_t pfl = Bn ? pf0 : Bn_lines;                                                            \
        for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {                                         \
            v8f s[4], n[4];                                                                            \
            qs_group(c, gi, s, n);                                                                    \
            const int64_t k1 = k0 + g < K ? k0 + g : K;                                               \
            for (int64_t k = k0; k < k1; ++k) {                                                       \
                const uint8_t *b = B + k * RB;                                                        \
                if (LINE_START(k, RB)) {                                                              \
                    const int64_t line = k * RB >> 6;                                                 \
                    if (line == pfl) {                                                                \
                        __builtin_prefetch(Bn + line * 64, 0, 2);                                     \
                        pfl += pfs;                                                                   \
                    }                                                                                 \
                    __builtin_prefetch(b + 512, 0, 3);                                                \
                }                                                                                     \
                v8f w[4];                                                                              \
                q_deq(b, BITS, s, n, w);                                                              \
                UNROLL_MR for (int r = 0; r < MR; ++r) {                                              \
                    const v8f a = v8f_set1(A[r * lda + k]);                                             \
                    UNROLL_MR for (int v = 0; v < 4; ++v) x[r][v] = v8f_fma(a, w[v], x[r][v]);         \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        Q_STORE_ROWS(x, MR);                                                                          \
    }
KERNEL(4, 1) KERNEL(4, 2) KERNEL(5, 1) KERNEL(5, 2)
KERNEL(6, 1) KERNEL(6, 2) KERNEL(8, 1) KERNEL(8, 2)


/* One panel's weights dequantized into W [K][32] fp32 as the register kernels compute them; the
 * next panel's codes (Bn, or NULL) prefetched into L2 meanwhile. */
static void dequant_panel(const uint8_t *B, int64_t K, int64_t g, const qsrc *c, int bits, float *W,
                          const uint8_t *Bn) {
    const int64_t RB = ROW_BYTES(bits);
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
        v8f s[4], n[4];
        qs_group(c, gi, s, n);
        const int64_t k1 = k0 + g < K ? k0 + g : K;
        for (int64_t k = k0; k < k1; ++k) {
            if (Bn && LINE_START(k, RB)) __builtin_prefetch(Bn + k * RB, 0, 2);
            v8f w[4];
            q_deq(B + k * RB, bits, s, n, w);
            for (int v = 0; v < 4; ++v) v8f_store(W + k * NR + 8 * v, w[v]);
        }
    }
}

typedef void (*kq_t)(const float *, int64_t, const uint8_t *, int64_t, int64_t, const qsrc *, float *, int64_t,
                     const float *, int64_t, const uint8_t *, int64_t, int64_t, int64_t);
static const kq_t KQ[4][MRQ + 1] = {{0, kq4_1, kq4_2}, {0, kq5_1, kq5_2}, {0, kq6_1, kq6_2}, {0, kq8_1, kq8_2}};
#if defined(__AVX2__) && defined(__FMA__)
/* Int8 activations on AVX2 (lmi_gemm_q's act8; the AVX-512 section gives the definition): the same quantized
 * rows and the same per-group fp32 operations in the same order, so the avx512 build's values bit for bit.
 * 4 rows k..k+3 become one 4-code dword per column (4-bit: two unpacks, two vpermq and two pshufb a 32
 * columns; 8-bit: eight in-lane unpacks, and each group's int32 sums put back in column order by their
 * 128-bit halves), and vpmaddubsw + vpmaddwd add 4 products into an int32 lane. 8-bit codes go in as
 * q - 128 with its sign moved onto the activation (2 x 128 x 127 < 2^15: vpmaddubsw's int16 pairs never
 * saturate), plus 128 x the group's activation sum. Rows in blocks of 2 (16 ymm registers). */
#define HAVE_Q_A8 1

static inline float a8_hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline int32_t a8_hsum(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}

static void a8_row(const float *a, int64_t K, int64_t g, int8_t *aq, float *da, float *sa, int32_t *si) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
        __m256 mx = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= g; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(a + k0 + i), sign));
        float amax = a8_hmax(mx);
        for (; i < g; ++i) {
            const float v = a[k0 + i] < 0.f ? -a[k0 + i] : a[k0 + i];
            amax = v > amax ? v : amax;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        __m256i sum = _mm256_setzero_si256();
        for (i = 0; i + 8 <= g; i += 8) {
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + k0 + i), _mm256_set1_ps(id)));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(aq + k0 + i), _mm_packs_epi16(w, w));
            sum = _mm256_add_epi32(sum, q);
        }
        int32_t s = a8_hsum(sum);
        for (; i < g; ++i) {            /* cvtss2si rounds as cvtps2dq: to nearest, ties to even */
            const int32_t q = _mm_cvtss_si32(_mm_set_ss(a[k0 + i] * id));
            aq[k0 + i] = (int8_t)q;
            s += q;
        }
        si[gi] = s;
        da[gi] = amax / 127.f;
        sa[gi] = da[gi] * (float)s;
    }
}

/* pshufb after vpermq 0xD8 of a 4-bit unpack: dword t of each lane <- rows 0-3's byte t (see a8_w4) */
static const uint8_t A8_SHUF4[32] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                     0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

/* Rows k..k+3 of 4-bit codes (64 bytes at b) -> w[v]: columns 8v..8v+7, one dword (rows 0-3) each. */
static inline void a8_w4(const uint8_t *b, __m256i sh, __m256i *w) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)b), x1 = _mm256_loadu_si256((const __m256i *)(b + 32));
    /* lane 0: rows 0/2 interleaved, lane 1: rows 1/3; vpermq puts rows 0/2 and 1/3 of 4 bytes in one lane */
    const __m256i t0 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpacklo_epi8(x0, x1), 0xD8), sh);
    const __m256i t1 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpackhi_epi8(x0, x1), 0xD8), sh);
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    w[0] = _mm256_and_si256(t0, lo4);                              /* bytes 0-7 low: columns 0-7 */
    w[1] = _mm256_and_si256(t1, lo4);                              /* bytes 8-15 low: columns 8-15 */
    w[2] = _mm256_and_si256(_mm256_srli_epi16(t0, 4), lo4);        /* high nibbles: columns 16-23 */
    w[3] = _mm256_and_si256(_mm256_srli_epi16(t1, 4), lo4);        /* 24-31 */
}

/* Rows k..k+3 of 8-bit codes (128 bytes at b) -> w[v] = q - 128 as int8, dwords for columns
 * {0-3 | 16-19}, {4-7 | 20-23}, {8-11 | 24-27}, {12-15 | 28-31} (v = 0..3; lane 0 | lane 1). */
static inline void a8_w8(const uint8_t *b, __m256i *w) {
    const __m256i *row = (const __m256i *)b;
    const __m256i r0 = _mm256_loadu_si256(row), r1 = _mm256_loadu_si256(row + 1);
    const __m256i r2 = _mm256_loadu_si256(row + 2), r3 = _mm256_loadu_si256(row + 3);
    const __m256i l01 = _mm256_unpacklo_epi8(r0, r1), h01 = _mm256_unpackhi_epi8(r0, r1);
    const __m256i l23 = _mm256_unpacklo_epi8(r2, r3), h23 = _mm256_unpackhi_epi8(r2, r3);
    const __m256i off = _mm256_set1_epi8((char)0x80);
    w[0] = _mm256_xor_si256(_mm256_unpacklo_epi16(l01, l23), off);
    w[1] = _mm256_xor_si256(_mm256_unpackhi_epi16(l01, l23), off);
    w[2] = _mm256_xor_si256(_mm256_unpacklo_epi16(h01, h23), off);
    w[3] = _mm256_xor_si256(_mm256_unpackhi_epi16(h01, h23), off);
}

#define KA8(BITS, MR, NAME, FROM_T)                                                                   \
    static void NAME##_##BITS##_##MR(const int8_t *aq, const float *da, const float *sa, const int32_t *si, \
                                  int64_t G, const uint8_t *B, int64_t K, int64_t g, const qsrc *c,   \
                                  float *C, int64_t ldc, const float *bias, int64_t ncols,            \
                                  const uint8_t *Bn) {                                                \
        const int64_t RB = ROW_BYTES(BITS);                                                           \
        const __m256i ones = _mm256_set1_epi16(1), sh = _mm256_loadu_si256((const __m256i *)A8_SHUF4); \
        (void)sh;                                                                                     \
        v8f y[MR][4];                                                                                  \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            UNROLL_MR for (int v = 0; v < 4; ++v) y[r][v] = v8f_zero();                                \
        }                                                                                             \
        for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {                                         \
            __m256i acc[MR][4];                                                                       \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                  \
                UNROLL_MR for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_si256();             \
            }                                                                                         \
            for (int64_t k = k0; k < k0 + g; k += 4) {                                                \
                __m256i w[4];                                                                         \
                if (FROM_T) {     /* B: the panel as a8_tpanel left it, 4 vectors a 4 rows */         \
                    for (int v = 0; v < 4; ++v) w[v] = _mm256_load_si256((const __m256i *)B + k + v); \
                } else {                                                                              \
                    const uint8_t *b = B + k * RB;                                                    \
                    if (Bn) {                                                                         \
                        _mm_prefetch((const char *)(Bn + k * RB), _MM_HINT_T1);                       \
                        if (BITS == 8) _mm_prefetch((const char *)(Bn + k * RB + 64), _MM_HINT_T1);   \
                    }                                                                                 \
                    _mm_prefetch((const char *)(b + 1024), _MM_HINT_T0);                              \
                    if (BITS == 4) a8_w4(b, sh, w);                                                   \
                    else a8_w8(b, w);                                                                 \
                }                                                                                     \
                UNROLL_MR for (int v = 0; v < 4; ++v) {                                               \
                    const __m256i aw = BITS == 4 ? w[v] : _mm256_abs_epi8(w[v]);                      \
                    UNROLL_MR for (int r = 0; r < MR; ++r) {                                          \
                        int32_t a4;                                                                   \
                        memcpy(&a4, aq + r * K + k, 4);                                               \
                        const __m256i av = BITS == 4 ? _mm256_set1_epi32(a4)                          \
                                                     : _mm256_sign_epi8(_mm256_set1_epi32(a4), w[v]);  \
                        acc[r][v] = _mm256_add_epi32(acc[r][v],                                       \
                                                     _mm256_madd_epi16(_mm256_maddubs_epi16(aw, av), ones)); \
                    }                                                                                 \
                }                                                                                     \
            }                                                                                         \
            v8f s[4], n[4];                                                                            \
            qs_group(c, gi, s, n);                                                                    \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                  \
                if (BITS == 8) {  /* column order back, and + 128 x the activations' sum */           \
                    const __m256i o = _mm256_set1_epi32(128 * si[r * G + gi]);                        \
                    const __m256i a0 = acc[r][0], a1 = acc[r][1], a2 = acc[r][2], a3 = acc[r][3];     \
                    acc[r][0] = _mm256_add_epi32(_mm256_permute2x128_si256(a0, a1, 0x20), o);         \
                    acc[r][1] = _mm256_add_epi32(_mm256_permute2x128_si256(a2, a3, 0x20), o);         \
                    acc[r][2] = _mm256_add_epi32(_mm256_permute2x128_si256(a0, a1, 0x31), o);         \
                    acc[r][3] = _mm256_add_epi32(_mm256_permute2x128_si256(a2, a3, 0x31), o);         \
                }                                                                                     \
                const v8f d = v8f_set1(da[r * G + gi]), sm = v8f_set1(sa[r * G + gi]);                   \
                UNROLL_MR for (int v = 0; v < 4; ++v)                                                 \
                    y[r][v] = v8f_fma(n[v], sm, v8f_fma(s[v], v8f_mul(_mm256_cvtepi32_ps(acc[r][v]), d), y[r][v])); \
            }                                                                                         \
        }                                                                                             \
        Q_STORE_ROWS(y, MR);                                                                          \
    }
#define MRA 2
KA8(4, 1, ka8, 0) KA8(4, 2, ka8, 0) KA8(8, 1, ka8, 0) KA8(8, 2, ka8, 0)
static const ka8_t KA8T[2][MRA + 1] = {{0, ka8_4_1, ka8_4_2}, {0, ka8_8_1, ka8_8_2}};

/* More than MRA rows (a prefill): each panel is transposed once into T (K x 32 bytes, L2), and blocks of
 * A8_TRANSPOSED rows run over it, so the transposition is paid once per panel, not once per 2 rows. The
 * same integer sums and epilogue: the same values as the register kernels (a row's result still depends
 * on that row only). */
#define A8_TRANSPOSED 3
static void a8_tpanel(const uint8_t *B, int64_t K, int bits, __m256i *T, const uint8_t *Bn) {
    const __m256i sh = _mm256_loadu_si256((const __m256i *)A8_SHUF4);
    const int64_t RB = ROW_BYTES(bits);
    for (int64_t k = 0; k < K; k += 4) {
        if (Bn) _mm_prefetch((const char *)(Bn + k * RB), _MM_HINT_T1);
        if (bits == 4) a8_w4(B + k * RB, sh, T + k);
        else a8_w8(B + k * RB, T + k);
    }
}
KA8(4, 1, kt8, 1) KA8(4, 2, kt8, 1) KA8(4, 3, kt8, 1) KA8(8, 1, kt8, 1) KA8(8, 2, kt8, 1) KA8(8, 3, kt8, 1)
static const ka8_t KT8T[2][A8_TRANSPOSED + 1] = {{0, kt8_4_1, kt8_4_2, kt8_4_3}, {0, kt8_8_1, kt8_8_2, kt8_8_3}};
#endif
#endif

/* The context of a grouped GEMM's panel loop (kernels/cpu_panel.h): the operands as lmi_gemm_q takes
 * them; W: nt per-thread dequantized panels (K x 32 fp32 each) or NULL; aq, da, sa, si: the int8 rows. */
typedef struct {
    const float *A, *bias, *D, *E;
    const uint8_t *Bp;
    const void *S, *Mn;
    float *C, *W;
    int64_t lda, K, N, ldc, g, G, sg, pbytes;
    int smode, bits;
    const int8_t *aq;
    const float *da, *sa;
    const int32_t *si;
    void *T;            /* int8 path: nt per-thread transposed panels (A8_TRANSPOSED) or NULL */
} q_ctx;

/* Threads for np panels: at most one a panel, at least one (as kernels/cpu_panel.h's loop). */
static inline int team(int nthreads, int64_t np) {
    return nthreads > np ? (int)np : nthreads < 1 ? 1 : nthreads;
}

#ifdef HAVE_Q_A8
/* Rows [row, row + rows) with int8 activations x panel p: with T, the panel transposed once (its
 * first row block, i == 0) into this thread's T and blocks of A8_TRANSPOSED rows over it; else the
 * register kernels, MRA rows a pass. The next panel's codes prefetched by the first row block. */
static void qa8_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    (void)nb;
    const q_ctx *c = (const q_ctx *)v;
    const int64_t K = c->K, G = c->G;
    const qsrc s = qsrc_panel(c->smode, c->S, c->Mn, c->D, c->E, c->sg, G, p);
    const uint8_t *B = c->Bp + p * c->pbytes, *Bn = next ? B + c->pbytes : 0;
    const int64_t ncols = c->N - p * NR < NR ? c->N - p * NR : NR;
    const float *bias = c->bias ? c->bias + p * NR : 0;
#ifdef A8_TRANSPOSED
    if (c->T) {
        __m256i *T = (__m256i *)c->T + (int64_t)omp_get_thread_num() * K;
        if (i == 0) a8_tpanel(B, K, c->bits, T, Bn);
        for (int64_t r0 = row; r0 < row + rows; r0 += A8_TRANSPOSED) {
            const int64_t mr = row + rows - r0 < A8_TRANSPOSED ? row + rows - r0 : A8_TRANSPOSED;
            KT8T[c->bits == 4 ? 0 : 1][mr](c->aq + r0 * K, c->da + r0 * G, c->sa + r0 * G, c->si + r0 * G, G,
                                           (const uint8_t *)T, K, c->g, &s, c->C + r0 * c->ldc + p * NR, c->ldc,
                                           bias, ncols, 0);
        }
        return;
    }
#endif
    for (int64_t r0 = row; r0 < row + rows; r0 += MRA) {
        const int64_t mr = row + rows - r0 < MRA ? row + rows - r0 : MRA;
        KA8T[c->bits == 4 ? 0 : 1][mr](c->aq + r0 * K, c->da + r0 * G, c->sa + r0 * G, c->si + r0 * G, G, B, K,
                                       c->g, &s, c->C + r0 * c->ldc + p * NR, c->ldc, bias, ncols,
                                       i == 0 && r0 == row ? Bn : 0);
    }
}

/* Every row with int8 activations over all panels (the caller checked a8_serves): the rows quantized
 * once, then kernels/cpu_panel.h's loop over qa8_block (a row's result depends on that row only).
 * Returns 0, C untouched, where the quantized rows cannot be allocated (the caller then takes the
 * exact path). */
static int gemm_q_a8(q_ctx *c, int64_t M, int64_t np, int nthreads) {
    const int64_t K = c->K, G = c->G;
    int8_t *aq = (int8_t *)malloc((size_t)(M * K + 64));
    float *da = (float *)malloc((size_t)(M * G * 3) * sizeof(float));
    if (!aq || !da) {
        free(aq), free(da);
        return 0;
    }
    float *sa = da + M * G;
    int32_t *si = (int32_t *)(sa + M * G);
    for (int64_t r = 0; r < M; ++r) a8_row(c->A + r * c->lda, K, c->g, aq + r * K, da + r * G, sa + r * G, si + r * G);
    c->aq = aq, c->da = da, c->sa = sa, c->si = si;
    int64_t mr = MRA;
#ifdef A8_TRANSPOSED
    /* more than MRA rows: each thread's panel transposed once into its T (K x 32 bytes, L2) */
    c->T = M > MRA ? aligned_alloc(64, (size_t)team(nthreads, np) * (size_t)K * 32) : 0;    /* K % 4 == 0 */
    if (c->T) mr = A8_TRANSPOSED;
#endif
    /* rows whose int8 activations stay in L2 (half of the fp32 paths' 1 MiB) */
    lmi_panel_drive(M, np, lmi_panel_chunk(2 * K, mr), mr, nthreads, qa8_block, 0, c);
    free(c->T);
    free(aq), free(da);
    return 1;
}

static int a8_serves(int act8, int64_t K, int bits, int64_t g) {
    return act8 && (bits == 4 || bits == 8) && g % 4 == 0 && g <= 256 && K % g == 0;
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || (defined(__ARM_NEON) && defined(__aarch64__))
/* Rows [row, row + rows) x panel p. A chunk of more than MRQ rows (nb > 1 or rows > MRQ) with
 * per-thread panels W: the panel dequantized once (by its first row block, i == 0) into this
 * thread's W, then kernels/cpu_gemm.c's fp32 row block over it (the same values, the same order);
 * else the register kernels, which dequantize as they multiply, MRQ rows a pass. */
static void q_block(const void *v, int64_t row, int64_t rows, int64_t p, int next, int64_t i, int64_t nb) {
    const q_ctx *c = (const q_ctx *)v;
    const int64_t K = c->K;
    const qsrc s = qsrc_panel(c->smode, c->S, c->Mn, c->D, c->E, c->sg, c->G, p);
    const uint8_t *B = c->Bp + p * c->pbytes, *Bn = next ? B + c->pbytes : 0;
    const int64_t ncols = c->N - p * NR < NR ? c->N - p * NR : NR;
    const float *bias = c->bias ? c->bias + p * NR : 0;
    float *C = c->C + row * c->ldc + p * NR;
    if (c->W && (nb > 1 || rows > MRQ)) {
        float *W = c->W + (int64_t)omp_get_thread_num() * K * NR;
        if (i == 0) dequant_panel(B, K, c->g, &s, c->bits, W, Bn);
        lmi_arch_gemm_block(c->A + row * c->lda, c->lda, W, K, C, c->ldc, bias, ncols, 0, 0, 1, rows);
        return;
    }
    const kq_t *kern = KQ[c->bits == 8 ? 3 : c->bits - 4];
    for (int64_t r0 = 0; r0 < rows; r0 += MRQ) {   /* (more than one pass only if W's allocation failed) */
        const int64_t mr = rows - r0 < MRQ ? rows - r0 : MRQ;
        kern[mr](c->A + (row + r0) * c->lda, c->lda, B, K, c->g, &s, C + r0 * c->ldc, c->ldc, bias, ncols,
                 r0 == 0 ? Bn : 0, c->pbytes >> 6, i, nb);
    }
}

/* A [M, K] fp32 at row stride lda (K contiguous); Bp, S, Mn, D, E as packed (see the top), smode
 * and sg their mode; bits 4, 5, 6 or 8; g the group size along K; bias [N] or NULL; C [M, N] at row
 * stride ldc. kernels/cpu_panel.h's loop (threads own contiguous ranges of panels; rows in chunks
 * whose A slice stays in L2, about 1 MiB). Up to MRQ rows a chunk: dequantized in registers as they
 * multiply; more: each panel dequantized once into W (K x 128 bytes, L2), then the fp32 row blocks of
 * up to MRF rows. act8: int8 activations (HAVE_Q_A8) where this build has them and the weight
 * qualifies (a8_serves); the layer's own setting (its pack), never the process's. */
void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const void *S,
                const void *Mn, const float *D, const float *E, int smode, int64_t sg, int bits, int64_t g,
                int64_t N, const float *bias, float *C, int64_t ldc, int act8, int nthreads) {
    const int64_t np = (N + NR - 1) / NR;
    q_ctx c = {A, bias, D, E, Bp, S, Mn, C, 0, lda, K, N, ldc, g, (K + g - 1) / g, sg, K * ROW_BYTES(bits),
               smode, bits, 0, 0, 0, 0, 0};
#ifdef HAVE_Q_A8
    if (a8_serves(act8, K, bits, g) && gemm_q_a8(&c, M, np, nthreads)) return;
#else
    (void)act8;
#endif
    const int64_t mr = M > MRQ ? MRF : MRQ;
    if (M > MRQ) c.W = (float *)aligned_alloc(64, (size_t)team(nthreads, np) * (size_t)K * NR * sizeof(float));
    lmi_panel_drive(M, np, lmi_panel_chunk(K * 4, mr), mr, nthreads, q_block, 0, &c);
    free(c.W);
}
#else
int lmi_gemm_q_available(void) { return 0; }

void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const void *S,
                const void *Mn, const float *D, const float *E, int smode, int64_t sg, int bits, int64_t g,
                int64_t N, const float *bias, float *C, int64_t ldc, int act8, int nthreads) {
    (void)A; (void)M; (void)K; (void)lda; (void)Bp; (void)S; (void)Mn; (void)D; (void)E; (void)smode; (void)sg;
    (void)bits; (void)g; (void)N; (void)bias; (void)C; (void)ldc; (void)act8; (void)nthreads;
}
#endif

/* lmi_gemm_q_act8_available: whether this build multiplies with int8 activations where lmi_gemm_q's
 * act8 asks for them (see HAVE_Q_A8 above: avx512 with VNNI and VBMI, or avx2); elsewhere act8 is ignored. */
int lmi_gemm_q_act8_available(void) {
#ifdef HAVE_Q_A8
    return 1;
#else
    return 0;
#endif
}
