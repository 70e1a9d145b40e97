/* int8 GEMM for CPU linear layers (option.quantize=int8): C[M, N] = dequant(A_q[M, K] @ W_q^T) (+ bias).
 *
 * Weights: int8 per output channel (symmetric, scale sw[n] = max|W[n, :]| / 127), packed once into
 * panels of 32 output columns and groups of 4 k: [ceil(N/32)][ceil(K/4)][32][4] int8, zero padded
 * (lmi_pack_i8). Activations: each row quantized per step to int8 by its own scale
 * (sa[m] = max|A[m, :]| / 127, round to nearest even), stored +128 as uint8 (lmi_quant_rows),
 * because VNNI's vpdpbusd multiplies unsigned by signed bytes: 4 u8 x 4 s8 products summed into
 * each int32 lane, 64 multiply-adds per instruction against 16 fp32 FMAs. The +128 is taken back
 * per column: acc - 128 * sum_k W_q[n, k] (wsum, from packing).
 *
 *   C[m, n] = sa[m] * sw[n] * (sum_k (A_q[m, k] + 128) W_q[n, k] - 128 wsum[n]) + bias[n]
 *
 * The integer sum is exact (|acc| < 2^31 for K < 2^16), so a row's result depends only on that row.
 * Same shape as kernels/cpu_gemm.c: up to 14 rows x 32 columns of int32 accumulators in 28 zmm
 * registers, each thread a contiguous range of panels, the next panel prefetched into L2 while
 * the current one multiplies; the weight stream is a quarter of fp32's.
 *
 * Needs AVX-512 VNNI (built with -march=native); elsewhere lmi_gemm_i8_available() returns 0 and
 * the caller dequantizes instead (handler/model/quant.py).
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NR 32
#define MRMAX 14

/* W [N, K] int8 row-major -> panels [ceil(N/32)][Kp/4][32][4] (Kp = K rounded up to 4), zero
 * padded; wsum[n] = sum_k W[n, k] (0 for padded columns). */
void lmi_pack_i8(const int8_t *W, int64_t N, int64_t K, int8_t *out, int32_t *wsum) {
    const int64_t np = (N + NR - 1) / NR, kq = (K + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; ++p)
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t n = p * NR + j;
            int32_t s = 0;
            for (int64_t q = 0; q < kq; ++q)
                for (int64_t i = 0; i < 4; ++i) {
                    const int64_t k = q * 4 + i;
                    const int8_t v = (n < N && k < K) ? W[n * K + k] : 0;
                    out[((p * kq + q) * NR + j) * 4 + i] = v;
                    s += v;
                }
            if (n < N) wsum[n] = s;
        }
}

/* A [M, K] fp32 at row stride lda -> out [M, Kp] uint8 (q + 128, zero padded: padding is 128,
 * i.e. q = 0) and scales [M] (0 for an all-zero row). */
void lmi_quant_rows(const float *A, int64_t M, int64_t K, int64_t lda, uint8_t *out, int64_t Kp,
                    float *scales, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t m = 0; m < M; ++m) {
        const float *a = A + m * lda;
        uint8_t *o = out + m * Kp;
        float amax = 0.f;
        int64_t k = 0;
#ifdef __AVX512F__
        /* 16 lanes at a time; the same values as the scalar loop: a * inv rounded to nearest
         * even (vcvtps2dq under the default rounding mode, as nearbyintf), then clamped. */
        __m512 vmax = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(a + k)));
        amax = _mm512_reduce_max_ps(vmax);
#endif
        for (; k < K; ++k) {
            const float v = fabsf(a[k]);
            amax = v > amax ? v : amax;
        }
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        scales[m] = s;
        k = 0;
#ifdef __AVX512F__
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
        for (; k + 16 <= K; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(a + k), vinv));
            q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
            _mm_storeu_si128((__m128i *)(o + k), _mm512_cvtepi32_epi8(q));
        }
#endif
        for (; k < K; ++k) {
            float q = nearbyintf(a[k] * inv);
            q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
            o[k] = (uint8_t)((int)q + 128);
        }
        for (k = K; k < Kp; ++k) o[k] = 128;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

int lmi_gemm_i8_available(void) { return 1; }

/* Named accumulators (c0_r, c1_r for rows r < MR), each row's code behind a compile-time `mr > r`:
 * written as arrays, gcc 12 kept them in memory (-O2: a load and a store around every vpdpbusd)
 * or spilled them (-O3), at 1.4x fp32's speed instead of the 2x+ that 4x the multiply-adds per
 * instruction allow. `mr` is each kernel's MR, a constant: the other rows' code is dropped. */
/* acc += a . b as one vpdpbusd on acc's own register: gcc 12's builtin copies the accumulator
 * between registers and the stack around each instruction (its one form leaves acc's register
 * to the allocator). */
#define DPBUSD(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)
#define DECL(r) __m512i c0_##r = _mm512_setzero_si512(), c1_##r = _mm512_setzero_si512();
#define STEP(r)                                                                                     \
    if (mr > r) {                                                                                   \
        const __m512i a = _mm512_set1_epi32(*(const int32_t *)(A + r * lda + q * 4));               \
        DPBUSD(c0_##r, a, b0);                                                                      \
        DPBUSD(c1_##r, a, b1);                                                                      \
    }
#define STORE(r)                                                                                    \
    if (mr > r) {                                                                                   \
        const __m512 a = _mm512_set1_ps(sa[r]);                                                     \
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(c0_##r, z0));                         \
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(c1_##r, z1));                         \
        _mm512_mask_storeu_ps(C + r * ldc, m0, _mm512_fmadd_ps(_mm512_mul_ps(v0, s0), a, bb0));     \
        _mm512_mask_storeu_ps(C + r * ldc + 16, m1, _mm512_fmadd_ps(_mm512_mul_ps(v1, s1), a, bb1)); \
    }

#define KERNEL(MR)                                                                                  \
    static void ki8_##MR(const uint8_t *A, int64_t lda, const int8_t *B, int64_t kq, float *C,      \
                         int64_t ldc, const float *sa, const float *sw, const int32_t *wsum,        \
                         const float *bias, int64_t ncols, const int8_t *Bn, int64_t pf0,           \
                         int64_t pfs) {                                                             \
        enum { mr = MR };                                                                           \
        FOR_ROWS(DECL)                                                                              \
        int64_t pfq = Bn ? pf0 : kq;                                                                \
        for (int64_t q = 0; q < kq; ++q) {                                                          \
            if (q == pfq) {                                                                         \
                _mm_prefetch((const char *)(Bn + q * NR * 4), _MM_HINT_T1);                         \
                _mm_prefetch((const char *)(Bn + q * NR * 4 + 64), _MM_HINT_T1);                    \
                pfq += pfs;                                                                         \
            }                                                                                       \
            const __m512i b0 = _mm512_loadu_si512((const void *)(B + q * NR * 4));                  \
            const __m512i b1 = _mm512_loadu_si512((const void *)(B + q * NR * 4 + 64));             \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 4), _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(B + (q + 8) * NR * 4 + 64), _MM_HINT_T0);                   \
            FOR_ROWS(STEP)                                                                          \
        }                                                                                           \
        const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);                 \
        const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0                                 \
                                                  : (__mmask16)((1u << (ncols - 16)) - 1);          \
        const __m512i z0 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m0, wsum), 7);                \
        const __m512i z1 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m1, wsum + 16), 7);           \
        const __m512 s0 = _mm512_maskz_loadu_ps(m0, sw), s1 = _mm512_maskz_loadu_ps(m1, sw + 16);   \
        const __m512 bb0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();            \
        const __m512 bb1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();       \
        FOR_ROWS(STORE)                                                                             \
    }
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)
KERNEL(7) KERNEL(8) KERNEL(9) KERNEL(10) KERNEL(11) KERNEL(12) KERNEL(13) KERNEL(14)

typedef void (*ki8_t)(const uint8_t *, int64_t, const int8_t *, int64_t, float *, int64_t, const float *,
                      const float *, const int32_t *, const float *, int64_t, const int8_t *, int64_t, int64_t);
static const ki8_t KI8[MRMAX + 1] = {0, ki8_1, ki8_2, ki8_3, ki8_4, ki8_5, ki8_6,
                                     ki8_7, ki8_8, ki8_9, ki8_10, ki8_11, ki8_12, ki8_13, ki8_14};

/* Aq [M, Kp] uint8 from lmi_quant_rows with its scales sa [M]; Bp, wsum from lmi_pack_i8; sw [N]
 * the weight scales; bias [N] or NULL; C [M, N] fp32 at row stride ldc. */
void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp,
                 const int32_t *wsum, const float *sw, int64_t N, const float *bias, float *C, int64_t ldc,
                 int nthreads) {
    const int64_t np = (N + NR - 1) / NR, kq = Kp / 4;
    int64_t chunk = ((1 << 20) / Kp) / MRMAX * MRMAX;
    if (chunk < MRMAX) chunk = MRMAX;
    if (nthreads > np) nthreads = (int)np;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = np * t / nt, p1 = np * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t Mc = M - m0 < chunk ? M - m0 : chunk;
            const int64_t nb = (Mc + MRMAX - 1) / MRMAX;
            for (int64_t p = p0; p < p1; ++p) {
                const int8_t *B = Bp + p * kq * NR * 4;
                const int8_t *Bn = p + 1 < p1 ? B + kq * NR * 4 : 0;
                const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
                for (int64_t i = 0; i < nb; ++i) {
                    const int64_t lo = Mc * i / nb, hi = Mc * (i + 1) / nb;
                    KI8[hi - lo](Aq + (m0 + lo) * Kp, Kp, B, kq, C + (m0 + lo) * ldc + p * NR, ldc,
                                 sa + m0 + lo, sw + p * NR, wsum + p * NR, bias ? bias + p * NR : 0, ncols,
                                 Bn, i, nb);
                }
            }
        }
    }
}
#else
int lmi_gemm_i8_available(void) { return 0; }

void lmi_gemm_i8(const uint8_t *Aq, int64_t M, int64_t Kp, const float *sa, const int8_t *Bp,
                 const int32_t *wsum, const float *sw, int64_t N, const float *bias, float *C, int64_t ldc,
                 int nthreads) {
    (void)Aq; (void)M; (void)Kp; (void)sa; (void)Bp; (void)wsum; (void)sw; (void)N; (void)bias; (void)C;
    (void)ldc; (void)nthreads;
}
#endif
