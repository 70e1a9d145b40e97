/* Why the avx2 int8 kernel (kernels/cpu_gemm_i8.c, no VNNI) is built as it is: throughput of the
 * instructions it could use, alone and in pairs, and of candidate inner loops over one weight panel
 * in L1, in cycles per row and 8-column unit of 4 k (32 multiply-adds), against fp32's 4 FMAs.
 *
 *   cc -O3 -march=x86-64-v3 -mtune=generic benchmarks/archive/i8_avx2_loops.c -o /tmp/i8_avx2_loops
 *   /tmp/i8_avx2_loops [GHz]        (GHz: the core's clock, to print cycles; default 3.47)
 *
 * Each figure is the best of 30 short runs by the thread's CPU time (robust to a shared host, not
 * to a sibling hyperthread's load). Pairs: 12 independent chains, 6 of each instruction; a pair
 * that runs at the single instruction's rate shares its pipes. Loops (named rows x units):
 *   sign   |W| (vpabsb) x q with W's sign (vpsignb) by vpmaddubsw, vpmaddwd by ones, vpaddd: the
 *          kernel before, and its one-row kernel now (exact: pairs <= 2 x 128 x 127)
 *   widen  activations int16 (q0, q2), (q1, q3) broadcast; weight words shifted into (w0, w2) and
 *          (w1, w3); 2 vpmaddwd + 2 vpaddd per row and unit: the kernel now (3 x 2)
 *   movsx  weight half-units sign-extended by vpmovsxbw against a 64-bit (q0..q3) broadcast
 *   pre    weights already int16 in memory (a per-call panel widening would be needed)
 *   fp32   kernels/cpu_gemm.c's avx2 block: 3 rows x 4 units of FMAs */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static volatile int sink;

/* ---- instruction pairs ---- */
#define MADDWD(x) __asm__("vpmaddwd %1,%0,%0" : "+x"(x) : "x"(b))
#define MADDUBS(x) __asm__("vpmaddubsw %1,%0,%0" : "+x"(x) : "x"(b))
#define SIGNB(x) __asm__("vpsignb %1,%0,%0" : "+x"(x) : "x"(b))
#define ADDD(x) __asm__("vpaddd %1,%0,%0" : "+x"(x) : "x"(b))
#define SRAW(x) __asm__("vpsraw $8,%0,%0" : "+x"(x))
#define FMA(x) __asm__("vfmadd231ps %1,%1,%0" : "+x"(x) : "x"(b))
#define MOVSX(x) __asm__("vpmovsxbw %1,%0" : "=x"(x) : "x"(_mm256_castsi256_si128(x)))
#define PAIR(A, B)                                                                                   \
    {                                                                                                \
        __m256i b = _mm256_set1_epi32(3), x0 = b, x1 = b, x2 = b, x3 = b, x4 = b, x5 = b, x6 = b,    \
                x7 = b, x8 = b, x9 = b, x10 = b, x11 = b;                                            \
        double best = 1e9;                                                                           \
        for (int r = 0; r < 30; ++r) {                                                               \
            double t = now();                                                                        \
            for (long i = 0; i < 200000; i++) {                                                      \
                A(x0); B(x1); A(x2); B(x3); A(x4); B(x5); A(x6); B(x7); A(x8); B(x9); A(x10); B(x11); \
            }                                                                                        \
            t = now() - t;                                                                           \
            if (t < best) best = t;                                                                  \
        }                                                                                            \
        __m256i s = _mm256_or_si256(_mm256_or_si256(_mm256_or_si256(x0, x1), _mm256_or_si256(x2, x3)), \
                                    _mm256_or_si256(_mm256_or_si256(x4, x5), _mm256_or_si256(x6, x7))); \
        s = _mm256_or_si256(s, _mm256_or_si256(_mm256_or_si256(x8, x9), _mm256_or_si256(x10, x11)));  \
        sink += _mm256_extract_epi32(s, 0);                                                          \
        printf("  %-8s + %-8s %.2f instructions per cycle\n", #A, #B, 12 * 200000 / best / ghz / 1e9); \
    }

/* ---- inner loops over one panel in L1 ---- */
#define KQ 224      /* k-groups: K = 896 */
static int8_t B[KQ * 128] __attribute__((aligned(64)));
static int16_t B16[KQ * 256] __attribute__((aligned(64)));
static uint8_t A8[8][KQ * 4] __attribute__((aligned(64)));
static int16_t A16[8][KQ * 4] __attribute__((aligned(64)));   /* (q0, q2, q1, q3) */
static int16_t A16n[8][KQ * 4] __attribute__((aligned(64)));  /* (q0, q1, q2, q3) */
static float Bf[KQ * 4 * 32] __attribute__((aligned(64))), Af[3][KQ * 4];
static inline __m256i bc(const void *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline __m256i bq(const void *p) { int64_t v; memcpy(&v, p, 8); return _mm256_set1_epi64x(v); }
#define RED(x) sink += _mm256_extract_epi32(x, 0)
#define ZERO(MR, NU) __m256i c[MR][NU]; for (int r = 0; r < MR; r++) for (int j = 0; j < NU; j++) c[r][j] = _mm256_setzero_si256();
#define DONE(MR, NU) for (int r = 0; r < MR; r++) for (int j = 0; j < NU; j++) RED(c[r][j]);
#define SIGN(NAME, MR, NU) __attribute__((noinline)) static void NAME(void) { ZERO(MR, NU)                  \
    const __m256i ones = _mm256_set1_epi16(1), x80 = _mm256_set1_epi8((char)0x80);                          \
    for (int q = 0; q < KQ; q++) { __m256i a[MR]; for (int r = 0; r < MR; r++) a[r] = _mm256_xor_si256(bc(A8[r] + q * 4), x80); \
        for (int j = 0; j < NU; j++) { __m256i w = _mm256_loadu_si256((void *)(B + q * 128 + 32 * j)), wa = _mm256_abs_epi8(w); \
            for (int r = 0; r < MR; r++) c[r][j] = _mm256_add_epi32(c[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(a[r], w)), ones)); } } \
    DONE(MR, NU) }
#define WIDEN(NAME, MR, NU) __attribute__((noinline)) static void NAME(void) { ZERO(MR, NU)                 \
    for (int q = 0; q < KQ; q++) { __m256i a[MR][2]; for (int r = 0; r < MR; r++) { a[r][0] = bc(A16[r] + q * 4); a[r][1] = bc(A16[r] + q * 4 + 2); } \
        for (int j = 0; j < NU; j++) { __m256i w = _mm256_loadu_si256((void *)(B + q * 128 + 32 * j));   \
            __m256i lo = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), hi = _mm256_srai_epi16(w, 8);     \
            for (int r = 0; r < MR; r++) c[r][j] = _mm256_add_epi32(c[r][j], _mm256_add_epi32(_mm256_madd_epi16(lo, a[r][0]), _mm256_madd_epi16(hi, a[r][1]))); } } \
    DONE(MR, NU) }
#define MOVSXL(NAME, MR, NU) __attribute__((noinline)) static void NAME(void) { ZERO(MR, 2 * NU)            \
    for (int q = 0; q < KQ; q++) { __m256i a[MR]; for (int r = 0; r < MR; r++) a[r] = bq(A16n[r] + q * 4); \
        for (int j = 0; j < 2 * NU; j++) { __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(B + q * 128 + 16 * j))); \
            for (int r = 0; r < MR; r++) c[r][j] = _mm256_add_epi32(c[r][j], _mm256_madd_epi16(w, a[r])); } } \
    DONE(MR, 2 * NU) }
#define PRE(NAME, MR, NU) __attribute__((noinline)) static void NAME(void) { ZERO(MR, NU)                   \
    for (int q = 0; q < KQ; q++) { __m256i a[MR][2]; for (int r = 0; r < MR; r++) { a[r][0] = bc(A16[r] + q * 4); a[r][1] = bc(A16[r] + q * 4 + 2); } \
        for (int j = 0; j < NU; j++) { const __m256i *w = (const __m256i *)(B16 + q * 256 + 32 * j);     \
            for (int r = 0; r < MR; r++) c[r][j] = _mm256_add_epi32(c[r][j], _mm256_add_epi32(_mm256_madd_epi16(_mm256_load_si256(w), a[r][0]), _mm256_madd_epi16(_mm256_load_si256(w + 1), a[r][1]))); } } \
    DONE(MR, NU) }
SIGN(sign_2x4, 2, 4) SIGN(sign_1x4, 1, 4) WIDEN(widen_3x2, 3, 2) WIDEN(widen_2x4, 2, 4) WIDEN(widen_1x4, 1, 4)
MOVSXL(movsx_1x4, 1, 4) MOVSXL(movsx_3x1, 3, 1) PRE(pre_3x2, 3, 2)
__attribute__((noinline)) static void fp32_3x4(void) {
    __m256 c[3][4];
    for (int r = 0; r < 3; r++) for (int j = 0; j < 4; j++) c[r][j] = _mm256_setzero_ps();
    for (int k = 0; k < KQ * 4; k++) {
        __m256 a[3];
        for (int r = 0; r < 3; r++) a[r] = _mm256_set1_ps(Af[r][k]);
        for (int j = 0; j < 4; j++) { __m256 b = _mm256_loadu_ps(Bf + k * 32 + 8 * j); for (int r = 0; r < 3; r++) c[r][j] = _mm256_fmadd_ps(a[r], b, c[r][j]); }
    }
    for (int r = 0; r < 3; r++) for (int j = 0; j < 4; j++) sink += (int)_mm256_cvtss_f32(c[r][j]);
}
#define LOOP(F, MR, NU)                                                                              \
    {                                                                                                \
        const int it = 20000 / (MR * NU);                                                            \
        double best = 1e9;                                                                           \
        F();                                                                                         \
        for (int rr = 0; rr < 30; rr++) {                                                            \
            double t = now();                                                                        \
            for (int i = 0; i < it; i++) F();                                                        \
            t = now() - t;                                                                           \
            if (t < best) best = t;                                                                  \
        }                                                                                            \
        printf("  %-10s %.2f cycles per row and unit\n", #F, best / ((double)it * KQ * MR * NU) * ghz * 1e9); \
    }

int main(int argc, char **argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 3.47;
    for (int i = 0; i < KQ * 128; i++) B[i] = (int8_t)(i * 37);
    for (int i = 0; i < KQ * 256; i++) B16[i] = (int16_t)(int8_t)(i * 37);
    for (int i = 0; i < KQ * 128; i++) Bf[i] = (float)(i % 7);
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < KQ * 4; i++) {
            A8[r][i] = (uint8_t)(i * 11 + r + 1);
            A16[r][i] = (int16_t)(A8[r][i] - 128);
            A16n[r][i] = (int16_t)(A8[r][i] - 128);
            if (r < 3) Af[r][i] = (float)(i % 5);
        }
    printf("instruction pairs (ymm), at %.2f GHz:\n", ghz);
    PAIR(FMA, FMA) PAIR(MADDWD, MADDWD) PAIR(MADDUBS, MADDUBS) PAIR(SIGNB, SIGNB) PAIR(ADDD, ADDD) PAIR(SRAW, SRAW)
    PAIR(MOVSX, MOVSX) PAIR(MADDWD, SIGNB) PAIR(MADDWD, MADDUBS) PAIR(MADDWD, FMA) PAIR(MADDWD, ADDD) PAIR(MADDWD, SRAW)
    PAIR(MADDWD, MOVSX)
    printf("inner loops, K = %d, one panel in L1:\n", KQ * 4);
    LOOP(sign_2x4, 2, 4) LOOP(sign_1x4, 1, 4) LOOP(widen_3x2, 3, 2) LOOP(widen_2x4, 2, 4) LOOP(widen_1x4, 1, 4)
    LOOP(movsx_1x4, 1, 4) LOOP(movsx_3x1, 3, 1) LOOP(pre_3x2, 3, 2) LOOP(fp32_3x4, 3, 4)
    return 0;
}
