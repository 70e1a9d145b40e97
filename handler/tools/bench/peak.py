"""The machine's fp32 arithmetic ceiling, and how close a server's token rate comes to it.

Two measurements of the fp32 FMA peak on `threads` threads (default 2, the servers' count):
- `c_fma`: a tiny C loop (gcc -O3 -march=native -fopenmp) of independent 512-bit (else
  256-bit) FMA chains, `ACC` accumulators per thread so the FMA latency is hidden: the
  instruction-level ceiling;
- `torch_mm`: a large fp32 torch.mm (oneDNN/MKL GEMM): what a tuned GEMM reaches.

Achieved GFLOP/s of a cell = 2 x parameters x (prompt + output tokens) / wall second: the usual
dense count (one multiply-add per weight per token), which leaves out attention's
score/value products and counts the tied LM head once (it is computed for every token here as
well, as an upper bound on the useful work: servers compute logits only for the last prompt
token, so the prompt side overstates the LM head's share).

`python -m handler.tools.bench.peak [--threads 2]` prints both as JSON.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

ACC = 12       # independent accumulators per thread: > FMA latency (4) x ports (2)

_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    long iters = atol(argv[1]);
    double t0 = omp_get_wtime();
    float sink = 0.f;
    #pragma omp parallel reduction(+:sink)
    {
#ifdef __AVX512F__
        __m512 a[ACC], b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
        for (int k = 0; k < ACC; k++) a[k] = _mm512_set1_ps((float)k);
        for (long i = 0; i < iters; i++)
            for (int k = 0; k < ACC; k++) a[k] = _mm512_fmadd_ps(a[k], b, c);
        for (int k = 0; k < ACC; k++) sink += _mm512_reduce_add_ps(a[k]);
#else
        __m256 a[ACC], b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
        for (int k = 0; k < ACC; k++) a[k] = _mm256_set1_ps((float)k);
        for (long i = 0; i < iters; i++)
            for (int k = 0; k < ACC; k++) a[k] = _mm256_fmadd_ps(a[k], b, c);
        float o[8];
        for (int k = 0; k < ACC; k++) { _mm256_storeu_ps(o, a[k]); sink += o[0]; }
#endif
    }
    double dt = omp_get_wtime() - t0;
#ifdef __AVX512F__
    int lanes = 16;
#else
    int lanes = 8;
#endif
    printf("{\"seconds\": %.6f, \"lanes\": %d, \"threads\": %d, \"sink\": %g}\n", dt, lanes,
           omp_get_max_threads(), sink);
    return 0;
}
"""


def flops(params: int, prompt_tokens: int, output_tokens: int) -> float:
    """2 x parameters x (prompt + output tokens): the dense multiply-adds of a run."""
    if params < 0 or prompt_tokens < 0 or output_tokens < 0:
        raise ValueError("params and token counts must be >= 0")
    return 2.0 * params * (prompt_tokens + output_tokens)


def achieved(params: int, prompt_tokens: int, output_tokens: int, seconds: float,
             peak_gflops: float | None = None) -> dict:
    """{"gflops": achieved GFLOP/s, "pct_of_peak": 100 x that / peak (None without a peak)}."""
    if seconds <= 0:
        return {"gflops": None, "pct_of_peak": None}
    g = flops(params, prompt_tokens, output_tokens) / seconds / 1e9
    return {"gflops": g, "pct_of_peak": 100.0 * g / peak_gflops if peak_gflops else None}


def count_params(model_dir: str) -> int:
    """Elements of every tensor in the model dir's safetensors files, read from their headers
    (no weights loaded): a tied LM head is stored, and counted, once."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no .safetensors file to count parameters from")
    total = 0
    for name in files:
        with open(os.path.join(model_dir, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, t in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for d in t["shape"]:
                count *= d
            total += count
    return total


def c_fma(threads: int = 2, seconds: float = 1.0) -> dict | None:
    """GFLOP/s of the C FMA loop on `threads` OpenMP threads (2 flops per lane per FMA), best
    of 3; None when there is no C compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "fma.c"), os.path.join(d, "fma")
        with open(src, "w") as f:
            f.write(_C.replace("ACC", str(ACC)))
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", src, "-o", exe], check=True, capture_output=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="spread")
        iters = 1_000_000
        best = None
        for _ in range(6):
            r = json.loads(subprocess.run([exe, str(iters)], check=True, capture_output=True, text=True,
                                          env=env).stdout)
            if r["seconds"] < 0.2:      # calibrate: runs of about `seconds`
                iters = int(iters * seconds / max(r["seconds"], 1e-3))
                continue
            g = 2 * r["lanes"] * ACC * iters * r["threads"] / r["seconds"] / 1e9
            best = g if best is None or g > best else best
    return {"gflops": best, "threads": threads, "accumulators": ACC, "compiler": cc,
            "flags": "-O3 -march=native -fopenmp"}


def torch_mm(threads: int = 2, n: int = 2048, reps: int = 10) -> dict | None:
    """GFLOP/s of an n x n x n fp32 torch.mm on `threads` threads, best of `reps`."""
    try:
        import torch
    except ImportError:
        return None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = None
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            dt = time.perf_counter() - t
            best = dt if best is None or dt < best else best
    finally:
        torch.set_num_threads(old)
    return {"gflops": 2 * n ** 3 / best / 1e9, "threads": threads, "n": n, "torch": torch.__version__}


def measure(threads: int = 2) -> dict:
    """Both ceilings; `peak_gflops` is the C loop's (the instruction ceiling), else torch's."""
    c, mm = c_fma(threads), torch_mm(threads)
    peak = (c or {}).get("gflops") or (mm or {}).get("gflops")
    return {"c_fma": c, "torch_mm": mm, "peak_gflops": peak, "threads": threads,
            "load_average": os.getloadavg()}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m handler.tools.bench.peak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    print(json.dumps(measure(ap.parse_args().threads), indent=2))
    sys.exit(0)
