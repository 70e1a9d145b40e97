/* The grouped-weight GEMM's x86 kernels (kernels/cpu_arch.h's lmi_arch_q_*; kernels/cpu_gemm_q4.c, whose
 * top gives the layout and the arithmetic, drives them). AVX-512: up to 12 rows x 32 columns of fp32
 * accumulators in 24 zmm registers; for each k, one 16-byte load widened to 16 int32 lanes, the two
 * nibbles split by a mask and a shift (5/6-bit: each plane's bits ORed in under a mask register),
 * converted to fp32 and dequantized by one FMA each with the group's scale/min (held in registers for
 * the group), then two FMAs per row; with VNNI and VBMI the int8-activation kernels (vpdpbusd, vpermb).
 * AVX2+FMA: kernels/cpu_v8.h's 8-lane kernels, and int8 activations by vpmaddubsw. Every path: the same
 * values bit for bit. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu_api.h"
#include "../cpu_arch.h"

#define NR 32
#define ROW_BYTES LMI_Q_ROW_BYTES
#define LINE_START LMI_Q_LINE_START
typedef lmi_qsrc qsrc;

/* An int8-activation kernel (HAVE_Q_A8 below): MR rows' quantized activations aq (row stride K), their
 * per-group da, sa and integer sums si (stride G) x one panel -> C; Bn: the next panel's codes or NULL. */
typedef void (*ka8_t)(const int8_t *aq, const float *da, const float *sa, const int32_t *si, int64_t G,
                      const uint8_t *B, int64_t K, int64_t g, const qsrc *c, float *C, int64_t ldc,
                      const float *bias, int64_t ncols, const uint8_t *Bn);

#if defined(__AVX512F__)
#include <immintrin.h>

#define MRMAX 12

/* The first n of 16 lanes (none for n <= 0, all for n >= 16): a panel's partial columns, a group's tail. */
static inline __mmask16 lanes16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* Group gi's 32 scales (s0: columns 0-15, s1: 16-31) and mins (n0, n1), in registers. Always inlined: with
 * every kernel below GCC's inlining budget left some kernels calling it once a group (4% at 4 rows of Q6_K). */
__attribute__((always_inline)) static inline void qs_group(const qsrc *c, int64_t gi, __m512 *s0, __m512 *s1,
                                                           __m512 *n0, __m512 *n1) {
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
#define DEQUANT dequant_panel

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* Int8 activations (lmi_gemm_q's act8), for every row count (so a request's tokens do not depend on what
 * it is batched with): each row quantized per group as llama.cpp's Q8 blocks,
 *   aq[k] = round_even(a[k] * 127 / amax_g),  da_g = amax_g / 127,  sa_g = da_g * sum_k aq[k],
 * and each group's codes multiplied by aq with vpdpbusd (4 codes x 4 int8 per lane, exact int32 sums),
 *   y += s * (float(sum_k q aq) * da_g) + m * sa_g        (fp32, per group, in group order)
 * So the codes stream through ~7 vector instructions per 128 weights (4-bit; 6-bit ~19) instead of ~36
 * for the exact fp32 dequantization; the result is not bit for bit the dequantized model's (the
 * activations are rounded to 8 bits per group). 4 rows k..k+3 are transposed into one 4-code dword per
 * column: 4-bit codes (nibbles) by one vpermb over the 4 rows' 64 bytes; 8-bit (bytes) by vpermt2b over
 * 128; 5/6-bit by vpermt2b over their 80/96 bytes (the second zmm a masked load: nothing past the 4 rows
 * is read), one for the nibble bytes and one per higher bit p gathering into each qword the 4 rows' plane
 * bytes that hold its 2 columns' bits (of either half), then per half one vpmultishiftqb bringing each
 * (column, row)'s bit to bit 4 + p of its byte and one vpternlogd ORing it in (measured on Zen 4: 1.2x
 * faster than a vpermt2b per plane and half with vptestmb against 1 << (column % 8) and a masked add; the
 * same as vpshufbitqmb, which would also need BITALG). The codes stay unsigned (0..63), so the vpdpbusd
 * and the epilogue are the 4-bit kernel's, and every code width gives the same values for the same
 * codes (a Q6_K weight streamed as bytes or as 6 bits). */
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

/* 5/6-bit, the 4 rows of RB = 20/24 bytes over two zmm: A8_NIB56 output byte 4j + r <- row r's nibble byte j.
 * A8_PLANE[p]: qword q (columns 2q, 2q + 1 of each half) byte 4h + r <- row r's plane-p byte 2h + q / 4,
 * which holds their bits at t = 2q % 8 and t + 1 (16 + 4p + 2h + q / 4 of the row). A8_SHIFT[p][h]:
 * vpmultishiftqb offsets, byte 8q + i (column j = 2q + i / 4, row r = i % 4) = 8 (4h + r) + j % 8 - 4 - p
 * (mod 64): that bit lands on bit 4 + p. */
#define P20(j) 0 + (j), 20 + (j), 40 + (j), 60 + (j)
#define P24(j) 0 + (j), 24 + (j), 48 + (j), 72 + (j)
#define PLQ(P, o) P(o), P((o) + 2)
#define PL(P, o) PLQ(P, o), PLQ(P, o), PLQ(P, o), PLQ(P, o), PLQ(P, (o) + 1), PLQ(P, (o) + 1), PLQ(P, (o) + 1), \
                 PLQ(P, (o) + 1)
#define SH4(x) (x) & 63, ((x) + 8) & 63, ((x) + 16) & 63, ((x) + 24) & 63
#define SHQ(b, t) SH4((b) + (t)), SH4((b) + (t) + 1)
#define SH(b) SHQ(b, 0), SHQ(b, 2), SHQ(b, 4), SHQ(b, 6), SHQ(b, 0), SHQ(b, 2), SHQ(b, 4), SHQ(b, 6)
static const uint8_t A8_NIB56[2][64] = {{P16(P20, 0)}, {P16(P24, 0)}};
static const uint8_t A8_PLANE[2][2][64] = {{{PL(P20, 16)}, {PL(P20, 20)}}, {{PL(P24, 16)}, {PL(P24, 20)}}};
static const uint8_t A8_SHIFT[2][2][64] = {{{SH(60)}, {SH(92)}}, {{SH(59)}, {SH(91)}}};

/* Those tables in registers, loaded once a kernel (a8_k56) for a8_w56. */
typedef struct {
    __m512i nib, plane[2], shift[2][2];
} a8_c56;

__attribute__((always_inline)) static inline a8_c56 a8_k56(int bits) {
    a8_c56 c;
    c.nib = _mm512_loadu_si512(A8_NIB56[bits == 6]);
    for (int p = 0; p < 2; ++p) {
        c.plane[p] = _mm512_loadu_si512(A8_PLANE[bits == 6][p]);
        c.shift[p][0] = _mm512_loadu_si512(A8_SHIFT[p][0]), c.shift[p][1] = _mm512_loadu_si512(A8_SHIFT[p][1]);
    }
    return c;
}

/* Rows k..k+3 of 5/6-bit codes (4 x RB bytes at b) -> w0, w1: columns 0-15 and 16-31, byte 4j + r the code of
 * column j (16 + j) in row r. */
__attribute__((always_inline)) static inline void a8_w56(const uint8_t *b, int bits, const a8_c56 *c, __m512i *w0,
                                                         __m512i *w1) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const __mmask64 tail = bits == 5 ? 0xFFFFull : 0xFFFFFFFFull;                   /* 80 / 96 bytes */
    const __m512i z0 = _mm512_loadu_si512(b), z1 = _mm512_maskz_loadu_epi8(tail, b + 64);
    const __m512i t = _mm512_permutex2var_epi8(z0, c->nib, z1);
    __m512i x0 = _mm512_and_si512(t, lo4), x1 = _mm512_and_si512(_mm512_srli_epi16(t, 4), lo4);
    for (int p = 0; p < bits - 4; ++p) {            /* w |= bit (4 + p) of the shifted byte */
        const __m512i hb = _mm512_set1_epi8((char)(16 << p));
        const __m512i x = _mm512_permutex2var_epi8(z0, c->plane[p], z1);
        x0 = _mm512_ternarylogic_epi32(x0, _mm512_multishift_epi64_epi8(c->shift[p][0], x), hb, 0xF8);
        x1 = _mm512_ternarylogic_epi32(x1, _mm512_multishift_epi64_epi8(c->shift[p][1], x), hb, 0xF8);
    }
    *w0 = x0, *w1 = x1;
}

/* MR rows (their quantized activations aq at row stride K, da / sa at stride G) x one panel -> C; FROM_T: B is
 * the panel as a8_tpanel left it (w0, w1 of rows k..k+3 at 32k bytes). */
#define KA8(BITS, MR, NAME, FROM_T)                                                                   \
    static void NAME##_##BITS##_##MR(const int8_t *aq, const float *da, const float *sa, const int32_t *si, \
                                  int64_t G, const uint8_t *B, int64_t K, int64_t g, const qsrc *c,   \
                                  float *C, int64_t ldc, const float *bias, int64_t ncols,            \
                                  const uint8_t *Bn) {                                                \
        (void)si;                                                                                     \
        const int64_t RB = ROW_BYTES(BITS);                                                           \
        const __m512i lo4 = _mm512_set1_epi8(0x0F);                                                   \
        const __m512i p0 = _mm512_loadu_si512(A8_PERM[BITS == 4 ? 0 : 1]), p1 = _mm512_loadu_si512(A8_PERM[2]); \
        const a8_c56 c56 = a8_k56(BITS);                                                              \
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
                if (FROM_T) {                                                                         \
                    w0 = _mm512_load_si512(B + 32 * k), w1 = _mm512_load_si512(B + 32 * k + 64);      \
                } else if (BITS == 4) {                                                               \
                    const __m512i t = _mm512_permutexvar_epi8(p0, _mm512_loadu_si512(b));             \
                    w0 = _mm512_and_si512(t, lo4);                                                    \
                    w1 = _mm512_and_si512(_mm512_srli_epi16(t, 4), lo4);                              \
                } else if (BITS != 8) {                                                               \
                    if (Bn) _mm_prefetch((const char *)(Bn + k * RB + 64), _MM_HINT_T1);              \
                    a8_w56(b, BITS, &c56, &w0, &w1);                                                  \
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
#define KA8S(BITS, NAME, FROM_T) KA8(BITS, 1, NAME, FROM_T) KA8(BITS, 2, NAME, FROM_T) KA8(BITS, 3, NAME, FROM_T) \
    KA8(BITS, 4, NAME, FROM_T) KA8(BITS, 5, NAME, FROM_T) KA8(BITS, 6, NAME, FROM_T)
KA8S(4, ka8, 0) KA8S(5, ka8, 0) KA8S(6, ka8, 0) KA8S(8, ka8, 0)
#define KA8ROW(BITS, NAME) {0, NAME##_##BITS##_1, NAME##_##BITS##_2, NAME##_##BITS##_3, NAME##_##BITS##_4, \
                            NAME##_##BITS##_5, NAME##_##BITS##_6}
static const ka8_t KA8T[4][MRA + 1] = {KA8ROW(4, ka8), KA8ROW(5, ka8), KA8ROW(6, ka8), KA8ROW(8, ka8)};

/* More than MRA rows of 5/6-bit codes (a prefill): each panel's codes transposed once into T (K x 32 bytes,
 * L2) and MRA-row blocks over it, so the bit-plane gathers (~2.5x the 4-bit transposition's instructions)
 * are paid once per panel, not once per 6 rows (measured at 64 rows x a Q6_K panel: 1.3x the 8-bit path's time
 * without). 4- and 8-bit codes are transposed by one or two vpermb a 4 rows: the register kernels serve
 * every row count. The same codes, integer sums and epilogue: the same values. */
#define A8_TRANSPOSED MRA
#define A8_TRANSPOSES(bits) ((bits) == 5 || (bits) == 6)
static void a8_tpanel(const uint8_t *B, int64_t K, int bits, uint8_t *T, const uint8_t *Bn) {
    const int64_t RB = ROW_BYTES(bits);
    const a8_c56 c = a8_k56(bits);
    for (int64_t k = 0; k < K; k += 4) {
        if (Bn) {
            _mm_prefetch((const char *)(Bn + k * RB), _MM_HINT_T1);
            _mm_prefetch((const char *)(Bn + k * RB + 64), _MM_HINT_T1);
        }
        __m512i w0, w1;
        a8_w56(B + k * RB, bits, &c, &w0, &w1);
        _mm512_store_si512(T + 32 * k, w0);
        _mm512_store_si512(T + 32 * k + 64, w1);
    }
}
KA8S(4, kt8, 1)      /* over T the codes are unsigned bytes, as 4-bit ones: the BITS = 4 instances */
static const ka8_t KT8T[2][A8_TRANSPOSED + 1] = {KA8ROW(4, kt8), {0}};     /* [bits == 8]: never transposed */
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define LMI_V8_Q
#include "../cpu_v8.h"

#define KQ V8_Q
#define MRQ V8_Q_ROWS
#define MRF V8_Q_DEQUANT_ROWS
#define DEQUANT v8_q_dequant

/* Int8 activations on AVX2 (lmi_gemm_q's act8; the AVX-512 section gives the definition): the same quantized
 * rows and the same per-group fp32 operations in the same order, so the avx512 build's values bit for bit.
 * 4 rows k..k+3 become one 4-code dword per column (4-bit: two unpacks, two vpermq and two pshufb a 32
 * columns; 5/6-bit: the same over the rows' nibble bytes, then each plane's bits ORed in by a pshufb, a
 * test and a mask per 8 columns; 8-bit: eight in-lane unpacks, and each group's int32 sums put back in
 * column order by their 128-bit halves), and vpmaddubsw + vpmaddwd add 4 products into an int32 lane
 * (5/6-bit codes are at most 63: 2 x 63 x 127 < 2^15, no saturation either). 8-bit codes go in as
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

/* Rows k..k+3's 16 nibble bytes (x0: rows 0 | 1, x1: rows 2 | 3, by 128-bit lane) -> w[v]: columns
 * 8v..8v+7, one dword (rows 0-3) each. */
static inline void a8_nib(__m256i x0, __m256i x1, __m256i sh, __m256i *w) {
    /* lane 0: rows 0/2 interleaved, lane 1: rows 1/3; vpermq puts rows 0/2 and 1/3 of 4 bytes in one lane */
    const __m256i t0 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpacklo_epi8(x0, x1), 0xD8), sh);
    const __m256i t1 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpackhi_epi8(x0, x1), 0xD8), sh);
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    w[0] = _mm256_and_si256(t0, lo4);                              /* bytes 0-7 low: columns 0-7 */
    w[1] = _mm256_and_si256(t1, lo4);                              /* bytes 8-15 low: columns 8-15 */
    w[2] = _mm256_and_si256(_mm256_srli_epi16(t0, 4), lo4);        /* high nibbles: columns 16-23 */
    w[3] = _mm256_and_si256(_mm256_srli_epi16(t1, 4), lo4);        /* 24-31 */
}

/* Rows k..k+3 of 4-bit codes (64 bytes at b) -> w as a8_nib. */
static inline void a8_w4(const uint8_t *b, __m256i sh, __m256i *w) {
    a8_nib(_mm256_loadu_si256((const __m256i *)b), _mm256_loadu_si256((const __m256i *)(b + 32)), sh, w);
}

/* pshufb for 5/6-bit planes: byte 4t + r of either lane <- byte 4r (row r's plane byte 0, + v for columns
 * 8v..); A8_BIT8: that byte's bit for column 8v + t (t = 0-3 in lane 0, 4-7 in lane 1) */
static const uint8_t A8_SHUFP[32] = {0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12,
                                     0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12};
static const uint8_t A8_BIT8[32] = {1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8,
                                    16, 16, 16, 16, 32, 32, 32, 32, 64, 64, 64, 64, 128, 128, 128, 128};

/* Rows k..k+3 of 5/6-bit codes (4 x RB bytes at b) -> w as a8_nib: the nibble bytes; then the 4 rows' plane
 * dwords gathered by overlapping loads and vpblendd (each row's at its own dword(s), within the 4 rows' bytes),
 * for plane p one vpermd putting rows 0-3's dwords in both lanes, and for each 8 columns v a pshufb of their
 * byte v to every (column, row) byte, a test of the column's bit and 16 << p where it is set. */
static inline void a8_w56(const uint8_t *b, int bits, __m256i sh, __m256i *w) {
    const int64_t RB = ROW_BYTES(bits);
    a8_nib(_mm256_loadu2_m128i((const __m128i *)(b + RB), (const __m128i *)b),
           _mm256_loadu2_m128i((const __m128i *)(b + 3 * RB), (const __m128i *)(b + 2 * RB)), sh, w);
    __m256i x, idx;
    if (bits == 5) {      /* plane dwords at 16 + 20r: rows 0, 1 at dwords 0, 5 of b + 16; 2, 3 at 2, 7 of b + 48 */
        x = _mm256_blend_epi32(_mm256_loadu_si256((const __m256i *)(b + 16)),
                               _mm256_loadu_si256((const __m256i *)(b + 48)), 0x84);
        idx = _mm256_setr_epi32(0, 5, 2, 7, 0, 5, 2, 7);
    } else {              /* plane qwords at 16 + 24r: row r at dwords 2r, 2r + 1 of b + 16 + 16r */
        const __m256i x01 = _mm256_blend_epi32(_mm256_loadu_si256((const __m256i *)(b + 16)),
                                               _mm256_loadu_si256((const __m256i *)(b + 32)), 0x0C);
        const __m256i x23 = _mm256_blend_epi32(_mm256_loadu_si256((const __m256i *)(b + 48)),
                                               _mm256_loadu_si256((const __m256i *)(b + 64)), 0xC0);
        x = _mm256_blend_epi32(x01, x23, 0xF0);
        idx = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    }
    const __m256i sel = _mm256_loadu_si256((const __m256i *)A8_SHUFP);
    const __m256i bit = _mm256_loadu_si256((const __m256i *)A8_BIT8);
    for (int p = 0; p < bits - 4; ++p) {
        const __m256i planes = _mm256_permutevar8x32_epi32(x, _mm256_add_epi32(idx, _mm256_set1_epi32(p)));
        const __m256i hb = _mm256_set1_epi8((char)(16 << p));
        for (int v = 0; v < 4; ++v) {
            const __m256i y = _mm256_shuffle_epi8(planes, _mm256_add_epi8(sel, _mm256_set1_epi8((char)v)));
            const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(y, bit), _mm256_setzero_si256());
            w[v] = _mm256_or_si256(w[v], _mm256_andnot_si256(clear, hb));
        }
    }
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
                        if (BITS != 4) _mm_prefetch((const char *)(Bn + k * RB + 64), _MM_HINT_T1);   \
                    }                                                                                 \
                    _mm_prefetch((const char *)(b + 1024), _MM_HINT_T0);                              \
                    if (BITS == 4) a8_w4(b, sh, w);                                                   \
                    else if (BITS == 8) a8_w8(b, w);                                                  \
                    else a8_w56(b, BITS, sh, w);                                                      \
                }                                                                                     \
                UNROLL_MR for (int v = 0; v < 4; ++v) {                                               \
                    const __m256i aw = BITS != 8 ? w[v] : _mm256_abs_epi8(w[v]);                      \
                    UNROLL_MR for (int r = 0; r < MR; ++r) {                                          \
                        int32_t a4;                                                                   \
                        memcpy(&a4, aq + r * K + k, 4);                                               \
                        const __m256i av = BITS != 8 ? _mm256_set1_epi32(a4)                          \
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
KA8(4, 1, ka8, 0) KA8(4, 2, ka8, 0) KA8(5, 1, ka8, 0) KA8(5, 2, ka8, 0)
KA8(6, 1, ka8, 0) KA8(6, 2, ka8, 0) KA8(8, 1, ka8, 0) KA8(8, 2, ka8, 0)
static const ka8_t KA8T[4][MRA + 1] = {{0, ka8_4_1, ka8_4_2}, {0, ka8_5_1, ka8_5_2}, {0, ka8_6_1, ka8_6_2},
                                       {0, ka8_8_1, ka8_8_2}};

/* More than MRA rows (a prefill): each panel is transposed once into T (K x 32 bytes, L2), and blocks of
 * A8_TRANSPOSED rows run over it, so the transposition is paid once per panel, not once per 2 rows (5/6-bit
 * codes transposed are unsigned bytes as 4-bit ones: the 4-bit kernels run over them). The
 * same integer sums and epilogue: the same values as the register kernels (a row's result still depends
 * on that row only). */
#define A8_TRANSPOSED 3
#define A8_TRANSPOSES(bits) ((void)(bits), 1)
static void a8_tpanel(const uint8_t *B, int64_t K, int bits, __m256i *T, const uint8_t *Bn) {
    const __m256i sh = _mm256_loadu_si256((const __m256i *)A8_SHUF4);
    const int64_t RB = ROW_BYTES(bits);
    for (int64_t k = 0; k < K; k += 4) {
        if (Bn) _mm_prefetch((const char *)(Bn + k * RB), _MM_HINT_T1);
        if (Bn && bits != 4) _mm_prefetch((const char *)(Bn + k * RB + 64), _MM_HINT_T1);
        if (bits == 4) a8_w4(B + k * RB, sh, T + k);
        else if (bits == 8) a8_w8(B + k * RB, T + k);
        else a8_w56(B + k * RB, bits, sh, T + k);
    }
}
KA8(4, 1, kt8, 1) KA8(4, 2, kt8, 1) KA8(4, 3, kt8, 1) KA8(8, 1, kt8, 1) KA8(8, 2, kt8, 1) KA8(8, 3, kt8, 1)
static const ka8_t KT8T[2][A8_TRANSPOSED + 1] = {{0, kt8_4_1, kt8_4_2, kt8_4_3}, {0, kt8_8_1, kt8_8_2, kt8_8_3}};
#else
#error "kernels/x86/ needs AVX2 and FMA at least (kernels/isa.py's avx2 or avx512 build)"
#endif

int lmi_arch_q_rows(void) { return MRQ; }
int lmi_arch_q_dequant_rows(void) { return MRF; }

void lmi_arch_q_block(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g,
                      const lmi_qsrc *c, float *C, int64_t ldc, const float *bias, int64_t ncols,
                      const uint8_t *Bn, int64_t Bn_lines, int64_t pf0, int64_t pfs, int bits, int64_t rows) {
    KQ[bits == 8 ? 3 : bits - 4][rows](A, lda, B, K, g, c, C, ldc, bias, ncols, Bn, Bn_lines, pf0, pfs);
}

void lmi_arch_q_dequant(const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, int bits, float *W,
                        const uint8_t *Bn) {
    DEQUANT(B, K, g, c, bits, W, Bn);
}

#ifdef HAVE_Q_A8
int lmi_arch_q_a8_rows(void) { return MRA; }

void lmi_arch_q_a8_row(const float *a, int64_t K, int64_t g, int8_t *aq, float *da, float *sa, int32_t *si) {
    a8_row(a, K, g, aq, da, sa, si);
}

void lmi_arch_q_a8_block(const int8_t *aq, const float *da, const float *sa, const int32_t *si, int64_t G,
                         const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, float *C, int64_t ldc,
                         const float *bias, int64_t ncols, const uint8_t *Bn, int transposed, int bits,
                         int64_t rows) {
#ifdef A8_TRANSPOSED
    if (transposed) {
        KT8T[bits == 8][rows](aq, da, sa, si, G, B, K, g, c, C, ldc, bias, ncols, 0);
        return;
    }
#else
    (void)transposed;
#endif
    KA8T[bits == 8 ? 3 : bits - 4][rows](aq, da, sa, si, G, B, K, g, c, C, ldc, bias, ncols, Bn);
}

#ifdef A8_TRANSPOSED
int lmi_arch_q_a8_transposed_rows(int bits) { return A8_TRANSPOSES(bits) ? A8_TRANSPOSED : 0; }

void lmi_arch_q_a8_transpose(const uint8_t *B, int64_t K, int bits, void *T, const uint8_t *Bn) {
    a8_tpanel(B, K, bits, T, Bn);
}
#else
int lmi_arch_q_a8_transposed_rows(int bits) { (void)bits; return 0; }

void lmi_arch_q_a8_transpose(const uint8_t *B, int64_t K, int bits, void *T, const uint8_t *Bn) {
    (void)B; (void)K; (void)bits; (void)T; (void)Bn;
}
#endif
#else
int lmi_arch_q_a8_rows(void) { return 0; }
int lmi_arch_q_a8_transposed_rows(int bits) { (void)bits; return 0; }

void lmi_arch_q_a8_row(const float *a, int64_t K, int64_t g, int8_t *aq, float *da, float *sa, int32_t *si) {
    (void)a; (void)K; (void)g; (void)aq; (void)da; (void)sa; (void)si;
}

void lmi_arch_q_a8_transpose(const uint8_t *B, int64_t K, int bits, void *T, const uint8_t *Bn) {
    (void)B; (void)K; (void)bits; (void)T; (void)Bn;
}

void lmi_arch_q_a8_block(const int8_t *aq, const float *da, const float *sa, const int32_t *si, int64_t G,
                         const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, float *C, int64_t ldc,
                         const float *bias, int64_t ncols, const uint8_t *Bn, int transposed, int bits,
                         int64_t rows) {
    (void)aq; (void)da; (void)sa; (void)si; (void)G; (void)B; (void)K; (void)g; (void)c; (void)C; (void)ldc;
    (void)bias; (void)ncols; (void)Bn; (void)transposed; (void)bits; (void)rows;
}
#endif
