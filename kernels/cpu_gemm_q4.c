/* Grouped 4-bit (and 8-bit) weight GEMM for CPU linear layers (AWQ, GPTQ, GGUF Q4_0/Q4_1/Q8_0):
 * C[M, N] = A[M, K] @ W^T (+ bias), fp32 activations (W4A16), with
 *
 *   W[n, k] = q[n, k] * S[n, k / g] + Mn[n, k / g]        q in 0..15 (4-bit) or 0..255 (8-bit)
 *
 * one scale and one offset ("min", = -zero * scale for AWQ/GPTQ) per output channel n and group
 * of g consecutive k (handler/model/quant_int4.py maps every format to this one).
 *
 * Layout (packed in handler/model/quant_int4.py): panels of 32 output columns as in
 * kernels/cpu_gemm.c. 4-bit: [ceil(N/32)][K][16] bytes, byte j of row k holding column j in its
 * low nibble and column j + 16 in its high nibble; 8-bit: [ceil(N/32)][K][32] bytes. S and Mn:
 * [ceil(N/32)][G][32] fp32 (G = ceil(K/g)), zero padded.
 *
 * Microkernel: up to 12 rows x 32 columns of fp32 accumulators in 24 zmm registers; for each k,
 * one 16-byte load widened to 16 int32 lanes, the two nibbles split by a mask and a shift,
 * converted to fp32 and dequantized by one FMA each with the group's scale/min (held in 4
 * registers for the group), then two FMAs per row. The dequantized weight is fma(q, s, m), exact
 * for every format served (q * s has at most 4 + 11 significant bits from an fp16 scale, and
 * q * s + m is itself the format's weight rounded once, as numpy's / torch's dequantization
 * rounds it), and each output is summed in k order by FMAs from 0, then + bias: the same
 * operations, in the same order, as kernels/cpu_gemm.c on the dequantized fp32 weights. So a
 * quantized model computes bit for bit what its dequantized fp32 model computes on this path.
 * A row's result depends only on that row.
 *
 * The weight stream is 1/8 of fp32's (plus 8 bytes per group of 32 columns' scale/min), so a
 * decode step, which streams every weight once, reads 8x fewer bytes; the dequantization costs
 * about 8 instructions per k per 32 columns, shared by the row block. Past one row block (M > 12)
 * each panel is instead dequantized once into a per-thread fp32 buffer (K x 32, in L2) and every
 * row block runs kernels/cpu_gemm.c's fp32 microkernel over it (the same values, the same
 * order), so compute-bound prefill steps pay one dequantization per panel, not one per row block.
 *
 * Builds (kernels/isa.py): avx512 as above; AVX2+FMA and aarch64 NEON over 8-lane vectors (register
 * kernel up to 2 rows, dequantized panels past that), the same values bit for bit. Elsewhere
 * lmi_gemm_q_available() returns 0 and the caller dequantizes in torch instead.
 */
#include <stdint.h>

#include "cpu_api.h"
#include <stdlib.h>

#define NR 32
#define MRMAX 12

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

int lmi_gemm_q_available(void) { return 1; }

/* MR rows of A x one panel (B: its packed weight, S/Mn: its [G][32] scales and mins) -> C.
 * Bn (or NULL): the next panel's weight, Bn_bytes long; row block pf0 of pfs prefetches every
 * pfs-th cache line of it into L2 so the panel's row blocks share the prefetching. */
#define KERNEL(BITS, MR)                                                                              \
    static void kq##BITS##_##MR(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g, \
                                const float *S, const float *Mn, float *C, int64_t ldc,              \
                                const float *bias, int64_t ncols, const uint8_t *Bn,                  \
                                int64_t Bn_lines, int64_t pf0, int64_t pfs) {                        \
        const int64_t RB = BITS == 4 ? 16 : 32; /* bytes per k */                                     \
        __m512 c0[MR], c1[MR];                                                                        \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            c0[r] = _mm512_setzero_ps();                                                              \
            c1[r] = _mm512_setzero_ps();                                                              \
        }                                                                                             \
        const __m512i lo4 = _mm512_set1_epi32(0xF);                                                   \
        int64_t pfl = Bn ? pf0 : Bn_lines;                                                            \
        for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {                                         \
            const __m512 s0 = _mm512_loadu_ps(S + gi * NR), s1 = _mm512_loadu_ps(S + gi * NR + 16);   \
            const __m512 n0 = _mm512_loadu_ps(Mn + gi * NR), n1 = _mm512_loadu_ps(Mn + gi * NR + 16); \
            const int64_t k1 = k0 + g < K ? k0 + g : K;                                               \
            for (int64_t k = k0; k < k1; ++k) {                                                       \
                const uint8_t *b = B + k * RB;                                                        \
                if ((k * RB & 63) == 0) {                                                             \
                    const int64_t line = k * RB >> 6;                                                 \
                    if (line == pfl) {                                                                \
                        _mm_prefetch((const char *)(Bn + line * 64), _MM_HINT_T1);                    \
                        pfl += pfs;                                                                   \
                    }                                                                                 \
                    _mm_prefetch((const char *)(b + 512), _MM_HINT_T0);                               \
                }                                                                                     \
                __m512i q0, q1;                                                                       \
                if (BITS == 4) {                                                                      \
                    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));      \
                    q0 = _mm512_and_si512(q, lo4);                                                    \
                    q1 = _mm512_srli_epi32(q, 4);                                                     \
                } else {                                                                              \
                    q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));                   \
                    q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));            \
                }                                                                                     \
                const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, n0);                    \
                const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, n1);                    \
                UNROLL_MR for (int r = 0; r < MR; ++r) {                                              \
                    const __m512 a = _mm512_set1_ps(A[r * lda + k]);                                  \
                    c0[r] = _mm512_fmadd_ps(a, w0, c0[r]);                                            \
                    c1[r] = _mm512_fmadd_ps(a, w1, c1[r]);                                            \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);                   \
        const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0                                   \
                                                  : (__mmask16)((1u << (ncols - 16)) - 1);            \
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
KERNEL(4, 1) KERNEL(4, 2) KERNEL(4, 3) KERNEL(4, 4) KERNEL(4, 5) KERNEL(4, 6)
KERNEL(4, 7) KERNEL(4, 8) KERNEL(4, 9) KERNEL(4, 10) KERNEL(4, 11) KERNEL(4, 12)
KERNEL(8, 1) KERNEL(8, 2) KERNEL(8, 3) KERNEL(8, 4) KERNEL(8, 5) KERNEL(8, 6)
KERNEL(8, 7) KERNEL(8, 8) KERNEL(8, 9) KERNEL(8, 10) KERNEL(8, 11) KERNEL(8, 12)

/* MR rows x one dequantized panel W [K][32] fp32 (in L1/L2) -> C: kernels/cpu_gemm.c's microkernel
 * (k-ordered FMAs from 0, then + bias), for row counts that span several row blocks. */
#define KERNF(MR)                                                                                     \
    static void kf_##MR(const float *A, int64_t lda, const float *W, int64_t K, float *C, int64_t ldc,  \
                        const float *bias, int64_t ncols) {                                           \
        __m512 c0[MR], c1[MR];                                                                        \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            c0[r] = _mm512_setzero_ps();                                                              \
            c1[r] = _mm512_setzero_ps();                                                              \
        }                                                                                             \
        for (int64_t k = 0; k < K; ++k) {                                                             \
            const __m512 b0 = _mm512_load_ps(W + k * NR), b1 = _mm512_load_ps(W + k * NR + 16);       \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                  \
                const __m512 a = _mm512_set1_ps(A[r * lda + k]);                                      \
                c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);                                                \
                c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);                                                \
            }                                                                                         \
        }                                                                                             \
        const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);                   \
        const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0                                   \
                                                  : (__mmask16)((1u << (ncols - 16)) - 1);            \
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
KERNF(1) KERNF(2) KERNF(3) KERNF(4) KERNF(5) KERNF(6)
KERNF(7) KERNF(8) KERNF(9) KERNF(10) KERNF(11) KERNF(12)
typedef void (*kf_t)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, int64_t);
static const kf_t KF[MRMAX + 1] = {0, kf_1, kf_2, kf_3, kf_4, kf_5, kf_6, kf_7, kf_8, kf_9, kf_10, kf_11, kf_12};

/* One panel's weights dequantized into W [K][32] fp32, exactly as the register kernels compute
 * them (fma(q, s, m)); the next panel's codes (Bn, or NULL) prefetched into L2 meanwhile. */
static void dequant_panel(const uint8_t *B, int64_t K, int64_t g, const float *S, const float *Mn, int bits,
                          float *W, const uint8_t *Bn) {
    const int64_t RB = bits == 4 ? 16 : 32;
    const __m512i lo4 = _mm512_set1_epi32(0xF);
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
        const __m512 s0 = _mm512_loadu_ps(S + gi * NR), s1 = _mm512_loadu_ps(S + gi * NR + 16);
        const __m512 n0 = _mm512_loadu_ps(Mn + gi * NR), n1 = _mm512_loadu_ps(Mn + gi * NR + 16);
        const int64_t k1 = k0 + g < K ? k0 + g : K;
        for (int64_t k = k0; k < k1; ++k) {
            const uint8_t *b = B + k * RB;
            if (Bn && (k * RB & 63) == 0) _mm_prefetch((const char *)(Bn + k * RB), _MM_HINT_T1);
            __m512i q0, q1;
            if (bits == 4) {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                q0 = _mm512_and_si512(q, lo4);
                q1 = _mm512_srli_epi32(q, 4);
            } else {
                q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
            }
            _mm512_store_ps(W + k * NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, n0));
            _mm512_store_ps(W + k * NR + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, n1));
        }
    }
}

typedef void (*kq_t)(const float *, int64_t, const uint8_t *, int64_t, int64_t, const float *, const float *,
                     float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, int64_t, int64_t);
static const kq_t KQ4[MRMAX + 1] = {0, kq4_1, kq4_2, kq4_3, kq4_4, kq4_5, kq4_6,
                                    kq4_7, kq4_8, kq4_9, kq4_10, kq4_11, kq4_12};
static const kq_t KQ8[MRMAX + 1] = {0, kq8_1, kq8_2, kq8_3, kq8_4, kq8_5, kq8_6,
                                    kq8_7, kq8_8, kq8_9, kq8_10, kq8_11, kq8_12};

/* A [M, K] fp32 at row stride lda (K contiguous); Bp, S, Mn as packed (see the top); bits 4 or 8;
 * g the group size along K; bias [N] or NULL; C [M, N] at row stride ldc. Threads own contiguous
 * ranges of panels; rows go in chunks whose A slice stays in L2 (about 1 MiB). */
void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const float *S,
                const float *Mn, int bits, int64_t g, int64_t N, const float *bias, float *C, int64_t ldc,
                int nthreads) {
    const int64_t np = (N + NR - 1) / NR, G = (K + g - 1) / g;
    const int64_t pbytes = K * (bits == 4 ? 16 : 32);
    const kq_t *kern = bits == 4 ? KQ4 : KQ8;
    int64_t chunk = ((1 << 20) / (K * 4)) / MRMAX * MRMAX;
    if (chunk < MRMAX) chunk = MRMAX;
    if (nthreads > np) nthreads = (int)np;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = np * t / nt, p1 = np * (t + 1) / nt;
        /* Several row blocks: each panel dequantized once into W (K x 128 bytes, L2), then the plain
         * fp32 microkernel per row block; one row block: dequantized in registers as it multiplies. */
        float *W = M > MRMAX ? (float *)aligned_alloc(64, (size_t)K * NR * sizeof(float)) : 0;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t Mc = M - m0 < chunk ? M - m0 : chunk;
            const int64_t nb = (Mc + MRMAX - 1) / MRMAX;
            for (int64_t p = p0; p < p1; ++p) {
                const uint8_t *B = Bp + p * pbytes;
                const uint8_t *Bn = p + 1 < p1 ? B + pbytes : 0;
                const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
                if (nb > 1 && W) {
                    dequant_panel(B, K, g, S + p * G * NR, Mn + p * G * NR, bits, W, Bn);
                    for (int64_t i = 0; i < nb; ++i) {
                        const int64_t lo = Mc * i / nb, hi = Mc * (i + 1) / nb;
                        KF[hi - lo](A + (m0 + lo) * lda, lda, W, K, C + (m0 + lo) * ldc + p * NR, ldc,
                                    bias ? bias + p * NR : 0, ncols);
                    }
                    continue;
                }
                for (int64_t i = 0; i < nb; ++i) {
                    const int64_t lo = Mc * i / nb, hi = Mc * (i + 1) / nb;
                    kern[hi - lo](A + (m0 + lo) * lda, lda, B, K, g, S + p * G * NR, Mn + p * G * NR,
                                  C + (m0 + lo) * ldc + p * NR, ldc, bias ? bias + p * NR : 0, ncols, Bn,
                                  pbytes >> 6, i, nb);
                }
            }
        }
        free(W);
    }
}
#elif (defined(__AVX2__) && defined(__FMA__)) || (defined(__ARM_NEON) && defined(__aarch64__))
/* AVX2+FMA and aarch64 NEON: the same packing, and per output the same operations in the same
 * order (weights fma(q, s, m); FMAs in k order from 0; then + bias), so the AVX-512 build's values
 * bit for bit. Vectors of 8 lanes (one ymm, or two NEON q registers); the 8 codes of a vector are
 * 8 bytes of a k's row: 4-bit bytes 0-7 hold columns 0-7 (low nibbles) and 16-23 (high), bytes
 * 8-15 columns 8-15 and 24-31. Up to MRQ rows run a whole panel in registers (4 accumulators a row:
 * 4 independent FMA chains, so one row is not held to the FMA latency); past that each panel is
 * dequantized once into W [K][32] fp32 and MRF-row blocks run over it (kernels/cpu_gemm.c's AVX2
 * block shape, 3 rows x 32 columns, the panel loads folded into the FMAs). On the AVX2 build's 16
 * ymm registers 3 rows in registers spilled, and the dequantized panel beat them at 3 rows. */
#include <omp.h>

#define MRQ 2
#define MRF 3

int lmi_gemm_q_available(void) { return 1; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 qf;
static inline qf qf_zero(void) { return _mm256_setzero_ps(); }
static inline qf qf_set1(float x) { return _mm256_set1_ps(x); }
static inline qf qf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void qf_store(float *p, qf v) { _mm256_storeu_ps(p, v); }
static inline qf qf_add(qf a, qf b) { return _mm256_add_ps(a, b); }
static inline qf qf_fma(qf a, qf b, qf c) { return _mm256_fmadd_ps(a, b, c); }    /* a * b + c, fused */
static inline __m256i q_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline qf qf_load_n(const float *p, int n) {     /* the first n lanes, 0 past them */
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, q_mask(n));
}
static inline void qf_store_n(float *p, qf v, int n) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else if (n > 0) _mm256_maskstore_ps(p, q_mask(n), v);
}
/* 8 bytes of 4-bit codes: low nibbles -> *lo = fma(q, s0, m0), high nibbles -> *hi = fma(q, s1, m1) */
static inline void q_deq4(const uint8_t *b, qf s0, qf m0, qf s1, qf m1, qf *lo, qf *hi) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xF))), s0, m0);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), s1, m1);
}
/* 8 bytes of 8-bit codes -> fma(q, s, m) */
static inline qf q_deq8(const uint8_t *b, qf s, qf m) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b))), s, m);
}
#else
#include <arm_neon.h>
#include <string.h>
typedef struct { float32x4_t lo, hi; } qf;
static inline qf qf_zero(void) { qf r = {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; return r; }
static inline qf qf_set1(float x) { qf r = {vdupq_n_f32(x), vdupq_n_f32(x)}; return r; }
static inline qf qf_load(const float *p) { qf r = {vld1q_f32(p), vld1q_f32(p + 4)}; return r; }
static inline void qf_store(float *p, qf v) { vst1q_f32(p, v.lo); vst1q_f32(p + 4, v.hi); }
static inline qf qf_add(qf a, qf b) { qf r = {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; return r; }
static inline qf qf_fma(qf a, qf b, qf c) { qf r = {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; return r; }
static inline qf qf_load_n(const float *p, int n) {
    if (n >= 8) return qf_load(p);
    float t[8] = {0};
    if (n > 0) memcpy(t, p, (size_t)n * 4);
    return qf_load(t);
}
static inline void qf_store_n(float *p, qf v, int n) {
    if (n >= 8) {
        qf_store(p, v);
    } else if (n > 0) {
        float t[8];
        qf_store(t, v);
        memcpy(p, t, (size_t)n * 4);
    }
}
static inline qf q_cvt8(uint8x8_t x, qf s, qf m) {     /* 8 codes -> fma(q, s, m) */
    const uint16x8_t w = vmovl_u8(x);
    qf r = {vfmaq_f32(m.lo, vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), s.lo),
            vfmaq_f32(m.hi, vcvtq_f32_u32(vmovl_high_u16(w)), s.hi)};
    return r;
}
static inline void q_deq4(const uint8_t *b, qf s0, qf m0, qf s1, qf m1, qf *lo, qf *hi) {
    const uint8x8_t x = vld1_u8(b);
    *lo = q_cvt8(vand_u8(x, vdup_n_u8(0xF)), s0, m0);
    *hi = q_cvt8(vshr_n_u8(x, 4), s1, m1);
}
static inline qf q_deq8(const uint8_t *b, qf s, qf m) { return q_cvt8(vld1_u8(b), s, m); }
#endif

/* MR rows of A x one panel (B: its codes, S/Mn: its [G][32] scales and mins) -> C. Bn (or NULL): the
 * next panel's codes, Bn_lines cache lines; row block pf0 of pfs prefetches every pfs-th line of it
 * into L2. A whole panel per pass: one row's 4 accumulators are 4 independent FMA chains, so one
 * row is not held to one FMA latency per 16 columns. */
#define KERNEL(BITS, MR)                                                                              \
    static void kq##BITS##_##MR(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g, \
                                const float *S, const float *Mn, float *C, int64_t ldc,              \
                                const float *bias, int64_t ncols, const uint8_t *Bn,                  \
                                int64_t Bn_lines, int64_t pf0, int64_t pfs) {                        \
        const int64_t RB = BITS == 4 ? 16 : 32; /* bytes per k */                                     \
        qf x[MR][4];                                                                                  \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            UNROLL_MR for (int v = 0; v < 4; ++v) x[r][v] = qf_zero();                                \
        }                                                                                             \
        int64_t pfl = Bn ? pf0 : Bn_lines;                                                            \
        for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {                                         \
            const float *sg = S + gi * NR, *mg = Mn + gi * NR;                                        \
            const qf s0 = qf_load(sg), s1 = qf_load(sg + 8), s2 = qf_load(sg + 16), s3 = qf_load(sg + 24); \
            const qf n0 = qf_load(mg), n1 = qf_load(mg + 8), n2 = qf_load(mg + 16), n3 = qf_load(mg + 24); \
            const int64_t k1 = k0 + g < K ? k0 + g : K;                                               \
            for (int64_t k = k0; k < k1; ++k) {                                                       \
                const uint8_t *b = B + k * RB;                                                        \
                if ((k * RB & 63) == 0) {                                                             \
                    const int64_t line = k * RB >> 6;                                                 \
                    if (line == pfl) {                                                                \
                        __builtin_prefetch(Bn + line * 64, 0, 2);                                     \
                        pfl += pfs;                                                                   \
                    }                                                                                 \
                    __builtin_prefetch(b + 512, 0, 3);                                                \
                }                                                                                     \
                qf w[4];                                                                              \
                if (BITS == 4) {                                                                      \
                    q_deq4(b, s0, n0, s2, n2, &w[0], &w[2]);                                          \
                    q_deq4(b + 8, s1, n1, s3, n3, &w[1], &w[3]);                                      \
                } else {                                                                              \
                    w[0] = q_deq8(b, s0, n0), w[1] = q_deq8(b + 8, s1, n1);                           \
                    w[2] = q_deq8(b + 16, s2, n2), w[3] = q_deq8(b + 24, s3, n3);                     \
                }                                                                                     \
                UNROLL_MR for (int r = 0; r < MR; ++r) {                                              \
                    const qf a = qf_set1(A[r * lda + k]);                                             \
                    UNROLL_MR for (int v = 0; v < 4; ++v) x[r][v] = qf_fma(a, w[v], x[r][v]);         \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        UNROLL_MR for (int v = 0; v < 4; ++v) {                                                       \
            const int n = ncols - 8 * v >= 8 ? 8 : ncols > 8 * v ? (int)(ncols - 8 * v) : 0;          \
            if (bias) {                                                                               \
                const qf bb = qf_load_n(bias + 8 * v, n);                                             \
                UNROLL_MR for (int r = 0; r < MR; ++r) x[r][v] = qf_add(x[r][v], bb);                 \
            }                                                                                         \
            UNROLL_MR for (int r = 0; r < MR; ++r) qf_store_n(C + r * ldc + 8 * v, x[r][v], n);       \
        }                                                                                             \
    }
KERNEL(4, 1) KERNEL(4, 2)
KERNEL(8, 1) KERNEL(8, 2)

/* MR rows x one dequantized panel W [K][32] fp32 -> C: k-ordered FMAs from 0, then + bias. */
#define KERNF(MR)                                                                                     \
    static void kf_##MR(const float *A, int64_t lda, const float *W, int64_t K, float *C, int64_t ldc,  \
                        const float *bias, int64_t ncols) {                                           \
        qf c[MR][4];                                                                                  \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                      \
            UNROLL_MR for (int v = 0; v < 4; ++v) c[r][v] = qf_zero();                                \
        }                                                                                             \
        for (int64_t k = 0; k < K; ++k) {                                                             \
            qf a[MR];                                                                                 \
            UNROLL_MR for (int r = 0; r < MR; ++r) a[r] = qf_set1(A[r * lda + k]);                    \
            UNROLL_MR for (int v = 0; v < 4; ++v) {                                                   \
                const qf b = qf_load(W + k * NR + 8 * v);                                             \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = qf_fma(a[r], b, c[r][v]);            \
            }                                                                                         \
        }                                                                                             \
        UNROLL_MR for (int v = 0; v < 4; ++v) {                                                       \
            const int n = ncols - 8 * v >= 8 ? 8 : ncols > 8 * v ? (int)(ncols - 8 * v) : 0;          \
            if (bias) {                                                                               \
                const qf bb = qf_load_n(bias + 8 * v, n);                                             \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = qf_add(c[r][v], bb);                 \
            }                                                                                         \
            UNROLL_MR for (int r = 0; r < MR; ++r) qf_store_n(C + r * ldc + 8 * v, c[r][v], n);       \
        }                                                                                             \
    }
KERNF(1) KERNF(2) KERNF(3)
typedef void (*kf_t)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, int64_t);
static const kf_t KF[MRF + 1] = {0, kf_1, kf_2, kf_3};

/* One panel's weights dequantized into W [K][32] fp32 as the register kernels compute them; the
 * next panel's codes (Bn, or NULL) prefetched into L2 meanwhile. */
static void dequant_panel(const uint8_t *B, int64_t K, int64_t g, const float *S, const float *Mn, int bits,
                          float *W, const uint8_t *Bn) {
    const int64_t RB = bits == 4 ? 16 : 32;
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
        const float *s = S + gi * NR, *m = Mn + gi * NR;
        const qf s0 = qf_load(s), s1 = qf_load(s + 8), s2 = qf_load(s + 16), s3 = qf_load(s + 24);
        const qf n0 = qf_load(m), n1 = qf_load(m + 8), n2 = qf_load(m + 16), n3 = qf_load(m + 24);
        const int64_t k1 = k0 + g < K ? k0 + g : K;
        for (int64_t k = k0; k < k1; ++k) {
            const uint8_t *b = B + k * RB;
            float *w = W + k * NR;
            if (Bn && (k * RB & 63) == 0) __builtin_prefetch(Bn + k * RB, 0, 2);
            if (bits == 4) {
                qf w0, w1, w2, w3;
                q_deq4(b, s0, n0, s2, n2, &w0, &w2);
                q_deq4(b + 8, s1, n1, s3, n3, &w1, &w3);
                qf_store(w, w0), qf_store(w + 8, w1), qf_store(w + 16, w2), qf_store(w + 24, w3);
            } else {
                qf_store(w, q_deq8(b, s0, n0)), qf_store(w + 8, q_deq8(b + 8, s1, n1));
                qf_store(w + 16, q_deq8(b + 16, s2, n2)), qf_store(w + 24, q_deq8(b + 24, s3, n3));
            }
        }
    }
}

typedef void (*kq_t)(const float *, int64_t, const uint8_t *, int64_t, int64_t, const float *, const float *,
                     float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, int64_t, int64_t);
static const kq_t KQ4[MRQ + 1] = {0, kq4_1, kq4_2};
static const kq_t KQ8[MRQ + 1] = {0, kq8_1, kq8_2};

/* As the AVX-512 lmi_gemm_q: up to MRQ rows in registers, more over each panel dequantized once. */
void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const float *S,
                const float *Mn, int bits, int64_t g, int64_t N, const float *bias, float *C, int64_t ldc,
                int nthreads) {
    const int64_t np = (N + NR - 1) / NR, G = (K + g - 1) / g;
    const int64_t pbytes = K * (bits == 4 ? 16 : 32);
    const kq_t *kern = bits == 4 ? KQ4 : KQ8;
    const int64_t mr = M > MRQ ? MRF : MRQ;
    int64_t chunk = ((1 << 20) / (K * 4)) / mr * mr;
    if (chunk < mr) chunk = mr;
    if (nthreads > np) nthreads = (int)np;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = np * t / nt, p1 = np * (t + 1) / nt;
        float *W = M > MRQ ? (float *)aligned_alloc(64, (size_t)K * NR * sizeof(float)) : 0;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t Mc = M - m0 < chunk ? M - m0 : chunk;
            const int64_t nb = (Mc + mr - 1) / mr;
            for (int64_t p = p0; p < p1; ++p) {
                const uint8_t *B = Bp + p * pbytes;
                const uint8_t *Bn = p + 1 < p1 ? B + pbytes : 0;
                const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
                if (W) {
                    dequant_panel(B, K, g, S + p * G * NR, Mn + p * G * NR, bits, W, Bn);
                    for (int64_t i = 0; i < nb; ++i) {
                        const int64_t lo = Mc * i / nb, hi = Mc * (i + 1) / nb;
                        KF[hi - lo](A + (m0 + lo) * lda, lda, W, K, C + (m0 + lo) * ldc + p * NR, ldc,
                                    bias ? bias + p * NR : 0, ncols);
                    }
                    continue;
                }
                const int64_t nq = (Mc + MRQ - 1) / MRQ;   /* (more than one block only if W's allocation failed) */
                for (int64_t i = 0; i < nq; ++i) {
                    const int64_t lo = Mc * i / nq, hi = Mc * (i + 1) / nq;
                    kern[hi - lo](A + (m0 + lo) * lda, lda, B, K, g, S + p * G * NR, Mn + p * G * NR,
                                  C + (m0 + lo) * ldc + p * NR, ldc, bias ? bias + p * NR : 0, ncols, Bn,
                                  pbytes >> 6, i, nq);
                }
            }
        }
        free(W);
    }
}
#else
int lmi_gemm_q_available(void) { return 0; }

void lmi_gemm_q(const float *A, int64_t M, int64_t K, int64_t lda, const uint8_t *Bp, const float *S,
                const float *Mn, int bits, int64_t g, int64_t N, const float *bias, float *C, int64_t ldc,
                int nthreads) {
    (void)A; (void)M; (void)K; (void)lda; (void)Bp; (void)S; (void)Mn; (void)bits; (void)g; (void)N;
    (void)bias; (void)C; (void)ldc; (void)nthreads;
}
#endif
