/* Kernels written once over the vector mapping (kernels/cpu_simd.h), included by the arch folders
 * that run them: the 8-lane row blocks of the AVX2 build (kernels/x86/) and of NEON (kernels/arm/), the
 * same panels and per output the same operations in the same order as the AVX-512 kernels, so the
 * same values bit for bit. The includer asks for a part by defining its name first:
 *
 *   LMI_V8_GEMM   fp32 panels: V8_GEMM[rows] (1..V8_GEMM_ROWS), V8_GEMM_CACHED[rows] (no prefetching)
 *   LMI_V8_BF16W  widened bf16 panels: V8_BF16W[rows] (1..V8_BF16W_ROWS)
 *   LMI_V8_I8     int8 panels over the includer's 8-column integer types: V8_I8[rows] (1..V8_I8_ROWS)
 *   LMI_V8_Q      grouped codes: V8_Q[bits][rows] (1..V8_Q_ROWS), v8_q_dequant
 *   LMI_VEC_LOOPS torch's vector loops over the includer's vf (VW lanes): kernels/cpu_arch.h's
 *                 lmi_arch_vec_lanes, _set_expf, _has_expf, _silu_f32, _silu_bf16, _bf16_binary
 *
 * (Every part needs NR, the panel width, defined as 32.) */
#ifndef LMI_CPU_V8_H
#define LMI_CPU_V8_H
#include <stdint.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_arch.h"
#include "cpu_simd.h"
#endif

#if defined(LMI_V8_GEMM) && !defined(LMI_V8_GEMM_DONE)
#define LMI_V8_GEMM_DONE
/* MR rows of A (row stride lda) x one fp32 panel B [K][32] -> C (row stride ldc), ncols <= 32 of them
 * stored; Bn / pf0 / pfs: the next panel's L2 prefetch, shared by the panel's row blocks. Blocks of
 * up to V8_GEMM_ROWS rows x 32 columns: AVX2's 16 ymm hold 3 rows' 12 accumulators and the row
 * broadcasts (the panel loads fold into the FMAs); NEON's 32 q registers 3 rows' 24 (4-lane
 * halves) beside the broadcasts and a panel load. */
#define V8_GEMM_ROWS 3
/* The L1 prefetch distance in k-rows of the panel (8 k-rows: 1 KiB). A 1-row block streams its panel from
 * memory at the loop's pace; an includer whose 1-row blocks get no next-panel L2 prefetch looks further
 * ahead by defining V8_GEMM_PFD1 (kernels/x86/gemm.c). */
#ifndef V8_GEMM_PFD1
#define V8_GEMM_PFD1 8
#endif
#define V8_GEMM_PFD(MR) ((MR) == 1 ? V8_GEMM_PFD1 : 8)
#define V8_GEMM_KERNEL(MR, NAME, PF)   /* PF 0: a panel already in the caches, nothing prefetched */ \
    static void NAME##_##MR(const float *A, int64_t lda, const float *B, int64_t K, float *C,           \
                        int64_t ldc, const float *bias, int64_t ncols, const float *Bn,             \
                        int64_t pf0, int64_t pfs) {                                                 \
        v8f c[MR][4];                                                                               \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            UNROLL_MR for (int v = 0; v < 4; ++v) c[r][v] = v8f_zero();                             \
        }                                                                                           \
        int64_t pfk = Bn ? pf0 : K;                                                                 \
        for (int64_t k = 0; k < K; ++k) {                                                           \
            if (PF && k == pfk) {                                                                   \
                LMI_PREFETCH_L2(Bn + k * NR);                                                       \
                LMI_PREFETCH_L2(Bn + k * NR + 16);                                                  \
                pfk += pfs;                                                                         \
            }                                                                                       \
            const float *b = B + k * NR;                                                            \
            if (PF) {                                                                               \
                LMI_PREFETCH_L1(b + V8_GEMM_PFD(MR) * NR);                                          \
                LMI_PREFETCH_L1(b + V8_GEMM_PFD(MR) * NR + 16);                                     \
            }                                                                                       \
            v8f a[MR];                                                                              \
            UNROLL_MR for (int r = 0; r < MR; ++r) a[r] = v8f_set1(A[r * lda + k]);                 \
            UNROLL_MR for (int v = 0; v < 4; ++v) {                                                 \
                LMI_V8_SEQ();                                                                       \
                const v8f bv = v8f_load(b + 8 * v);                                                 \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_fma(a[r], bv, c[r][v]);        \
            }                                                                                       \
        }                                                                                           \
        UNROLL_MR for (int v = 0; v < 4; ++v) {                                                     \
            const int n = (int)(ncols - 8 * v);                                                     \
            if (n <= 0) break;                                                                      \
            if (bias) {                                                                             \
                const v8f bb = v8f_load_n(bias + 8 * v, n);                                         \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_add(c[r][v], bb);              \
            }                                                                                       \
            UNROLL_MR for (int r = 0; r < MR; ++r) v8f_store_n(C + r * ldc + 8 * v, c[r][v], n);    \
        }                                                                                           \
    }
V8_GEMM_KERNEL(1, v8_gemm, 1) V8_GEMM_KERNEL(2, v8_gemm, 1) V8_GEMM_KERNEL(3, v8_gemm, 1)
V8_GEMM_KERNEL(1, v8_gemmc, 0) V8_GEMM_KERNEL(2, v8_gemmc, 0) V8_GEMM_KERNEL(3, v8_gemmc, 0)

typedef void (*v8_gemm_t)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *,
                       int64_t, const float *, int64_t, int64_t);
static const v8_gemm_t V8_GEMM[V8_GEMM_ROWS + 1] = {0, v8_gemm_1, v8_gemm_2, v8_gemm_3};
static const v8_gemm_t V8_GEMM_CACHED[V8_GEMM_ROWS + 1] = {0, v8_gemmc_1, v8_gemmc_2, v8_gemmc_3};
#endif

#if defined(LMI_V8_BF16W) && !defined(LMI_V8_BF16W_DONE)
#define LMI_V8_BF16W_DONE
/* Widened bf16 panels (kernels/cpu_gemm_bf16.c's lmi_pack_bf16): MR rows of fp32 A x one panel -> C,
 * fp32 or rounded to bf16 (out_bf16). Per pair, each 8-column quarter of the panel is loaded and
 * widened once (k = 2q: shifted left 16 bits; k = 2q+1: the high half) and feeds the block's rows,
 * whose two broadcasts per row stay in registers (AVX2: 8 accumulators + 4 broadcasts + 3 of 16 ymm). */
#define V8_BF16W_ROWS 2
#define V8_BF16W_KERNEL(MR)                                                                                 \
    static void v8_bf16w_##MR(const float *A, int64_t lda, const uint16_t *B, int64_t K, void *C,         \
                        int64_t ldc, int out_bf16, const float *bias, int64_t ncols,                \
                        const uint16_t *Bn, int64_t pf0, int64_t pfs) {                             \
        v8f c[MR][4];                                                                               \
        UNROLL_MR for (int r = 0; r < MR; ++r) {                                                    \
            UNROLL_MR for (int v = 0; v < 4; ++v) c[r][v] = v8f_zero();                             \
        }                                                                                           \
        const int64_t kq = (K + 1) / 2, kfull = K / 2;                                              \
        int64_t pfq = Bn ? pf0 : kq;                                                                \
        for (int64_t q = 0; q < kfull; ++q) {                                                       \
            if (q == pfq) {                                                                         \
                LMI_PREFETCH_L2(Bn + q * NR * 2);                                                   \
                LMI_PREFETCH_L2(Bn + q * NR * 2 + 32);                                              \
                pfq += pfs;                                                                         \
            }                                                                                       \
            const uint16_t *w = B + q * NR * 2;                                                     \
            LMI_PREFETCH_L1(w + 8 * NR * 2);                                                        \
            LMI_PREFETCH_L1(w + 8 * NR * 2 + 32);                                                   \
            v8f ae[MR], ao[MR];                                                                     \
            UNROLL_MR for (int r = 0; r < MR; ++r) {                                                \
                ae[r] = v8f_set1(A[r * lda + 2 * q]);                                               \
                ao[r] = v8f_set1(A[r * lda + 2 * q + 1]);                                           \
            }                                                                                       \
            UNROLL_MR for (int v = 0; v < 4; ++v) {                                                 \
                LMI_V8_SEQ();                                                                       \
                const v8f e = v8f_bf16_lo(w + 16 * v), o = v8f_bf16_hi(w + 16 * v);                \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_fma(ae[r], e, c[r][v]);        \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_fma(ao[r], o, c[r][v]);        \
            }                                                                                       \
        }                                                                                           \
        if (kfull < kq) { /* odd K: the last value alone */                                         \
            const uint16_t *w = B + kfull * NR * 2;                                                 \
            UNROLL_MR for (int v = 0; v < 4; ++v) {                                                 \
                const v8f e = v8f_bf16_lo(w + 16 * v);                                              \
                UNROLL_MR for (int r = 0; r < MR; ++r)                                              \
                    c[r][v] = v8f_fma(v8f_set1(A[r * lda + K - 1]), e, c[r][v]);                    \
            }                                                                                       \
        }                                                                                           \
        UNROLL_MR for (int v = 0; v < 4; ++v) {                                                     \
            const int n = (int)(ncols - 8 * v);                                                     \
            if (n <= 0) break;                                                                      \
            if (bias) {                                                                             \
                const v8f bb = v8f_load_n(bias + 8 * v, n);                                         \
                UNROLL_MR for (int r = 0; r < MR; ++r) c[r][v] = v8f_add(c[r][v], bb);              \
            }                                                                                       \
            if (out_bf16) {                                                                         \
                UNROLL_MR for (int r = 0; r < MR; ++r)                                              \
                    v8f_store_bf16_n((uint16_t *)C + r * ldc + 8 * v, c[r][v], n);                  \
            } else {                                                                                \
                UNROLL_MR for (int r = 0; r < MR; ++r) v8f_store_n((float *)C + r * ldc + 8 * v, c[r][v], n); \
            }                                                                                       \
        }                                                                                           \
    }
V8_BF16W_KERNEL(1) V8_BF16W_KERNEL(2)

typedef void (*v8_bf16w_t)(const float *, int64_t, const uint16_t *, int64_t, void *, int64_t, int,
                     const float *, int64_t, const uint16_t *, int64_t, int64_t);
static const v8_bf16w_t V8_BF16W[V8_BF16W_ROWS + 1] = {0, v8_bf16w_1, v8_bf16w_2};
#endif

#if defined(LMI_V8_I8) && !defined(LMI_V8_I8_DONE)
#define LMI_V8_I8_DONE
/* int8 panels (kernels/cpu_gemm_i8.c's lmi_pack_i8) over the includer's 8-column integer types
 * (i8acc, i8row, i8w, i8f and their operations: kernels/x86/gemm_i8.c for AVX-VNNI, kernels/arm/gemm_i8.c
 * for sdot): each k-group of a panel is 4 units of 8 columns x 4 k (32 bytes); each unit adds a row's
 * 4-k dot product to 8 int32 lanes. */
#define V8_I8_ROWS 3
/* MR rows of Aq (row stride lda) x one panel B [kq][32][4] -> C (row stride ldc), ncols <= 32 of
 * them stored. Bn (or NULL): the next panel, whose k-groups pf0, pf0 + pfs, ... this row block
 * prefetches into L2 (the panel's row blocks share the prefetching). Named accumulators, each
 * row's code behind a compile-time `mr > r` (as arrays, gcc 12 kept some on the stack). */
#define FOR_ROWS3(X) X(0) X(1) X(2)
#define DECL(r) i8acc c##r##_0 = i8acc_zero(), c##r##_1 = c##r##_0, c##r##_2 = c##r##_0, c##r##_3 = c##r##_0; \
                i8row a##r;
#define LOADA(r) if (mr > r) a##r = i8row_load(A + r * lda + q * 4);
#define DOT(r, j) if (mr > r) c##r##_##j = i8_dot(c##r##_##j, a##r, w);
#define DOT0(r) DOT(r, 0)
#define DOT1(r) DOT(r, 1)
#define DOT2(r) DOT(r, 2)
#define DOT3(r) DOT(r, 3)
#define OUT(r, j)                                                                                     \
    if (mr > r) i8f_store_n(C + r * ldc + 8 * j, i8_epilogue(i8_unoffset(c##r##_##j, wsum + 8 * j, n), s, sa[r], bb), n);
#define OUT0(r) OUT(r, 0)
#define OUT1(r) OUT(r, 1)
#define OUT2(r) OUT(r, 2)
#define OUT3(r) OUT(r, 3)
#define UNIT(j)                                                                                       \
    {                                                                                                 \
        const i8w w = i8w_load(b + j * 32);                                                           \
        FOR_ROWS3(DOT##j)                                                                             \
    }
#define EPI(j)                                                                                        \
    if (ncols > 8 * j) {                                                                              \
        const int n = ncols - 8 * j >= 8 ? 8 : (int)(ncols - 8 * j);                                  \
        const i8f s = i8f_load_n(sw + 8 * j, n), bb = i8f_load_n(bias ? bias + 8 * j : 0, bias ? n : 0); \
        FOR_ROWS3(OUT##j)                                                                             \
    }

#define KERNEL(MR)                                                                                    \
    static void ki8_##MR(const uint8_t *A, int64_t lda, const int8_t *B, int64_t kq, float *C,        \
                         int64_t ldc, const float *sa, const float *sw, const int32_t *wsum,          \
                         const float *bias, int64_t ncols, const int8_t *Bn, int64_t pf0, int64_t pfs) { \
        enum { mr = MR };                                                                             \
        FOR_ROWS3(DECL)                                                                               \
        int64_t pfq = Bn ? pf0 : kq;                                                                  \
        for (int64_t q = 0; q < kq; ++q) {                                                            \
            const int8_t *b = B + q * NR * 4;                                                         \
            if (q == pfq) {                                                                           \
                __builtin_prefetch(Bn + q * NR * 4, 0, 2);                                            \
                __builtin_prefetch(Bn + q * NR * 4 + 64, 0, 2);                                       \
                pfq += pfs;                                                                           \
            }                                                                                         \
            __builtin_prefetch(b + 8 * NR * 4, 0, 3);                                                 \
            __builtin_prefetch(b + 8 * NR * 4 + 64, 0, 3);                                            \
            FOR_ROWS3(LOADA)                                                                          \
            UNIT(0) UNIT(1) UNIT(2) UNIT(3)                                                           \
        }                                                                                             \
        EPI(0) EPI(1) EPI(2) EPI(3)                                                                   \
    }
typedef void (*ki8_t)(const uint8_t *, int64_t, const int8_t *, int64_t, float *, int64_t, const float *,
                      const float *, const int32_t *, const float *, int64_t, const int8_t *, int64_t, int64_t);
KERNEL(1) KERNEL(2) KERNEL(3)
static const ki8_t V8_I8[V8_I8_ROWS + 1] = {0, ki8_1, ki8_2, ki8_3};
#endif

#if defined(LMI_V8_Q) && !defined(LMI_V8_Q_DONE)
#define LMI_V8_Q_DONE
/* Grouped codes (kernels/cpu_gemm_q4.c): the same packing, and per output the same operations in the same
 * order (weights fma(q, s, m); FMAs in k order from 0; then + bias), so the AVX-512 build's values
 * bit for bit. Vectors of 8 lanes (one ymm, or two NEON q registers); the 8 codes of a vector are
 * 8 bytes of a k's row: bytes 0-7 hold columns 0-7 (low nibbles) and 16-23 (high), bytes 8-15
 * columns 8-15 and 24-31; byte i of a bit plane holds columns 8i..8i+7. Up to V8_Q_ROWS rows run a whole
 * panel in registers (4 accumulators a row: 4 independent FMA chains, so one row is not held to the
 * FMA latency); past that each panel is dequantized once into W [K][32] fp32 and V8_Q_DEQUANT_ROWS-row blocks run
 * over it (kernels/cpu_gemm.c's AVX2 block shape, 3 rows x 32 columns, the panel loads folded into
 * the FMAs). On the AVX2 build's 16 ymm registers 3 rows in registers spilled, and the dequantized
 * panel beat them at 3 rows. */
#define V8_Q_ROWS 2
#define V8_Q_DEQUANT_ROWS 3

/* Group gi's scales and mins, 4 vectors each (see the top's modes). */
static inline void qs_group(const lmi_qsrc *c, int64_t gi, v8f *s, v8f *m) {
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
#define V8_Q_KERNEL(BITS, MR)                                                                              \
    static void kq##BITS##_##MR(const float *A, int64_t lda, const uint8_t *B, int64_t K, int64_t g, \
                                const lmi_qsrc *c, float *C, int64_t ldc,                                 \
                                const float *bias, int64_t ncols, const uint8_t *Bn,                  \
                                int64_t Bn_lines, int64_t pf0, int64_t pfs) {                        \
        const int64_t RB = LMI_Q_ROW_BYTES(BITS);                                                           \
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
                if (LMI_Q_LINE_START(k, RB)) {                                                              \
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
V8_Q_KERNEL(4, 1) V8_Q_KERNEL(4, 2) V8_Q_KERNEL(5, 1) V8_Q_KERNEL(5, 2)
V8_Q_KERNEL(6, 1) V8_Q_KERNEL(6, 2) V8_Q_KERNEL(8, 1) V8_Q_KERNEL(8, 2)


/* One panel's weights dequantized into W [K][32] fp32 as the register kernels compute them; the
 * next panel's codes (Bn, or NULL) prefetched into L2 meanwhile. */
static void v8_q_dequant(const uint8_t *B, int64_t K, int64_t g, const lmi_qsrc *c, int bits, float *W,
                          const uint8_t *Bn) {
    const int64_t RB = LMI_Q_ROW_BYTES(bits);
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
        v8f s[4], n[4];
        qs_group(c, gi, s, n);
        const int64_t k1 = k0 + g < K ? k0 + g : K;
        for (int64_t k = k0; k < k1; ++k) {
            if (Bn && LMI_Q_LINE_START(k, RB)) __builtin_prefetch(Bn + k * RB, 0, 2);
            v8f w[4];
            q_deq(B + k * RB, bits, s, n, w);
            for (int v = 0; v < 4; ++v) v8f_store(W + k * NR + 8 * v, w[v]);
        }
    }
}

typedef void (*kq_t)(const float *, int64_t, const uint8_t *, int64_t, int64_t, const lmi_qsrc *, float *, int64_t,
                     const float *, int64_t, const uint8_t *, int64_t, int64_t, int64_t);
static const kq_t V8_Q[4][V8_Q_ROWS + 1] = {{0, kq4_1, kq4_2}, {0, kq5_1, kq5_2}, {0, kq6_1, kq6_2}, {0, kq8_1, kq8_2}};
#endif

#if defined(LMI_VEC_LOOPS) && !defined(LMI_VEC_LOOPS_DONE)
#define LMI_VEC_LOOPS_DONE
/* torch's vector loops over the includer's vf (VW lanes: torch's Vectorized<float>) and its vload,
 * vstore, vneg, vadd, vmul, vdiv, vone, vload_bf16, vstore_bf16: kernels/cpu_layer.c's SiLU and bf16
 * element-wise steps, whole vectors only (each returns how many elements it did). */
typedef vf (*expf_t)(vf);
static expf_t sleef_expf;

int lmi_arch_vec_lanes(void) { return VW; }
void lmi_arch_set_expf(void *fn) { sleef_expf = (expf_t)fn; }
int lmi_arch_has_expf(void) { return sleef_expf != 0; }

static inline vf silu_v(vf x) { return vdiv(x, vadd(vone(), sleef_expf(vneg(x)))); }

/* torch's vectorized_loop over [0, n): two vectors per iteration (the rest: the caller's scalar op) */
int64_t lmi_arch_silu_f32(float *g, int64_t n) {
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        vstore(g + i, silu_v(vload(g + i)));
        vstore(g + i + VW, silu_v(vload(g + i + VW)));
    }
    return i;
}

int64_t lmi_arch_silu_bf16(uint16_t *g, int64_t n) {
    int64_t i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW)    /* Vectorized<BFloat16> is 2 * VW wide: two a loop, as float pairs */
        for (int j = 0; j < 4 * VW; j += VW)
            vstore_bf16(g + i + j, silu_v(vload_bf16(g + i + j)));
    return i;
}

/* g[i] <- round(g[i] * u[i]) (bf16, products in fp32), or g[i] <- g[i] + u[i] when add */
int64_t lmi_arch_bf16_binary(uint16_t *g, const uint16_t *u, int64_t n, int add) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf a = vload_bf16(g + i), b = vload_bf16(u + i);
        vstore_bf16(g + i, add ? vadd(a, b) : vmul(a, b));
    }
    return i;
}
#endif
