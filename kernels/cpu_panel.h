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
#endif
