/* The one loop of the panel GEMMs (kernels/cpu_gemm.c, cpu_gemm_bf16.c, cpu_gemm_i8.c), every build:
 * each build supplies only its row-block kernels, behind `block`.
 *
 * Weights are packed in np panels of 32 output columns; each of up to nthreads threads owns a
 * contiguous range of panels. Rows go in chunks of `chunk` (whose activations stay in L2, about
 * 1 MiB), each chunk split into near-equal row blocks of at most `mr` rows. For each chunk a
 * thread runs every row block against each of its panels in turn, so a panel is read from memory
 * once per chunk and from the caches by the chunk's other row blocks:
 *
 *   block(ctx, row, rows, p, next, i, nb)   rows [row, row + rows) x panel p; `next`: the thread's
 *                                           next panel exists (p + 1), whose L2 prefetch the panel's
 *                                           nb row blocks share: block i takes its k-steps i,
 *                                           i + nb, ... (kernels' pf0 / pfs)
 *   prep(ctx, row, rows, t, nt)             or NULL: thread t of nt prepares its share of a chunk's
 *                                           rows before any block of the chunk runs (a barrier
 *                                           between), e.g. widening the activations
 *
 * A row's outputs depend on that row only (each kernel's sums run in k order whatever the block),
 * so the partition changes no value. */
#ifndef LMI_CPU_PANEL_H
#define LMI_CPU_PANEL_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef void (*lmi_panel_block_fn)(const void *ctx, int64_t row, int64_t rows, int64_t p, int next, int64_t i,
                                   int64_t nb);
typedef void (*lmi_panel_prep_fn)(const void *ctx, int64_t row, int64_t rows, int t, int nt);

/* The rows per chunk for activation rows of `row_bytes` bytes: about 1 MiB, whole blocks of mr. */
static inline int64_t lmi_panel_chunk(int64_t row_bytes, int64_t mr) {
    const int64_t c = ((1 << 20) / (row_bytes > 0 ? row_bytes : 1)) / mr * mr;
    return c < mr ? mr : c;
}

static inline void lmi_panel_drive(int64_t M, int64_t np, int64_t chunk, int64_t mr, int nthreads,
                                   lmi_panel_block_fn block, lmi_panel_prep_fn prep, const void *ctx) {
    if (nthreads > np) nthreads = (int)np;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = np * t / nt, p1 = np * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t Mc = M - m0 < chunk ? M - m0 : chunk;
            const int64_t nb = (Mc + mr - 1) / mr;
            if (prep) {
                prep(ctx, m0, Mc, t, nt);
#pragma omp barrier
            }
            for (int64_t p = p0; p < p1; ++p)
                for (int64_t i = 0; i < nb; ++i) {
                    const int64_t lo = Mc * i / nb, hi = Mc * (i + 1) / nb;
                    block(ctx, m0 + lo, hi - lo, p, p + 1 < p1, i, nb);
                }
            if (prep) {   /* the next chunk's prep overwrites what this chunk's blocks read */
#pragma omp barrier
            }
        }
    }
}

/* A padded copy of A. Rows at a stride that is a multiple of 4 KiB fall in the same L1 sets (one set
 * of an 8-way 32 KiB L1 for every row of a block), so a row block's broadcasts keep missing: fp32,
 * K = 3072 (a ViT's MLP down projection), M = 1,024 measured 132 GFLOP/s against 212 with the rows
 * 64 bytes further apart (AMD Zen 4, 2 threads; benchmarks/results/vlm-smolvlm-r2/README.md). Such A
 * (of at least LMI_PANEL_PAD_ROWS rows) is copied a chunk at a time, by the loop's prep, to a stride of an
 * odd number of cache lines; the kernels read the same values, so no output changes.
 * A GEMM's context starts with its lmi_panel_pad, so that lmi_panel_pad_prep serves as every GEMM's prep. */
#define LMI_PANEL_PAD_ROWS 8

typedef struct {
    const char *src;
    char *dst;                      /* the chunk's copy, or NULL: A read where it is */
    int64_t row_bytes, lda_bytes, ldp_bytes, chunk;
} lmi_panel_pad;

/* pd for A (M rows of row_bytes at a stride of lda_bytes; blocks of mr rows): the copy when the
 * stride aliases and its buffer is had. Returns the rows per chunk to drive. The caller frees pd->dst. */
static inline int64_t lmi_panel_pad_init(lmi_panel_pad *pd, const void *A, int64_t M, int64_t row_bytes,
                                         int64_t lda_bytes, int64_t mr) {
    pd->src = (const char *)A;
    pd->dst = 0;
    pd->row_bytes = row_bytes;
    pd->lda_bytes = pd->ldp_bytes = lda_bytes;
    pd->chunk = lmi_panel_chunk(row_bytes, mr);
    if (M >= LMI_PANEL_PAD_ROWS && lda_bytes % 4096 == 0) {
        const int64_t lines = (row_bytes + 63) / 64, ldp = (lines | 1) * 64;  /* an odd count of lines: the
                                                                                rows cycle through every set */
        int64_t chunk = lmi_panel_chunk(ldp, mr);
        if (chunk > M) chunk = M;
        char *d = (char *)malloc((size_t)(chunk * ldp));
        if (d) {                    /* else: A where it is, the same values */
            pd->dst = d;
            pd->ldp_bytes = ldp;
            pd->chunk = chunk;
        }
    }
    return pd->chunk;
}

/* The loop's prep for a context that starts with its lmi_panel_pad: thread t of nt copies its share
 * of the chunk's rows. */
static inline void lmi_panel_pad_prep(const void *ctx, int64_t row, int64_t rows, int t, int nt) {
    const lmi_panel_pad *pd = (const lmi_panel_pad *)ctx;
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; ++r)
        memcpy(pd->dst + r * pd->ldp_bytes, pd->src + (row + r) * pd->lda_bytes, (size_t)pd->row_bytes);
}

/* lmi_panel_drive over A read through pd, the first member of ctx: the copy set up where A's rows alias,
 * the chunks driven (each copied first by lmi_panel_pad_prep), the copy freed. */
static inline void lmi_panel_drive_rows(lmi_panel_pad *pd, const void *A, int64_t M, int64_t row_bytes,
                                        int64_t lda_bytes, int64_t np, int64_t mr, int nthreads,
                                        lmi_panel_block_fn block, const void *ctx) {
    const int64_t chunk = lmi_panel_pad_init(pd, A, M, row_bytes, lda_bytes, mr);
    lmi_panel_drive(M, np, chunk, mr, nthreads, block, pd->dst ? lmi_panel_pad_prep : 0, ctx);
    free(pd->dst);
    pd->dst = 0;
}

/* Row `row` of A as the kernels read it (the chunk's copy: chunks start at multiples of pd->chunk). */
static inline const void *lmi_panel_pad_row(const lmi_panel_pad *pd, int64_t row) {
    return pd->dst ? pd->dst + (row % pd->chunk) * pd->ldp_bytes : pd->src + row * pd->lda_bytes;
}
#endif
