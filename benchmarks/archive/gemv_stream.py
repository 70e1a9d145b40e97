"""One-row (decode at one client) GEMM streaming rate against the host's read bandwidth.

    python benchmarks/archive/gemv_stream.py [--threads 1,2] [--shapes qwen2.5-0.5b] [--layers 24] [--rounds 3]
        [--what bw,fp32,int8,step] [--out FILE.json]

bw     the host's read bandwidth: a C loop of 512-bit (or 256-bit) loads summing a 512 MiB fp32 buffer
       over `threads` OpenMP threads (each a contiguous slice), best of 5; torch's copy_ of the same
       buffer beside it (handler/tools/bench/floor.py's probe: bytes copied per second); the read loop
       again with software prefetches 8 KiB ahead (read_pf: whether more lines in flight stream faster)
fp32   kernels/cpu_gemm.c's lmi_gemm on 1 row, per shape: `layers` copies of the weight cycled one per
       call (as a step walks its layers, so they stream from memory, not L3), best of `rounds` rounds;
       GB/s = panel bytes / time per call
int8   kernels/cpu_gemm_i8.c's lmi_quant_rows + lmi_gemm_i8 the same way
step   a whole step's GEMMs in layer order (qkv, o, gate|up, down) x layers + the head: the
       GEMM-only floor of a 1-row decode step, and its rate

Weights are filled with a constant (timing does not depend on values; no packing needed); the kernels
are called through ctypes on preallocated buffers.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kernels import cpu as cpu_ext  # noqa: E402
from benchmarks.script_common import write_json  # noqa: E402

# (name, K, N) of one layer's linears (fused as the server holds them) and the head, per model
SHAPES = {
    "qwen2.5-0.5b": [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 2 * 4864), ("down", 4864, 896),
                     ("head", 896, 151936)],
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 2 * 1536), ("down", 1536, 576),
                ("head", 576, 49152)],
}
LAYERS = {"qwen2.5-0.5b": 24, "smollm2": 30}

PROBE_C = r"""
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>
float probe_read(const float *p, int64_t n, int nthreads, int64_t pf) {
    float total = 0.f;
#pragma omp parallel num_threads(nthreads) reduction(+:total)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = n * t / nt / 64 * 64, hi = t + 1 == nt ? n : n * (t + 1) / nt / 64 * 64;
#if defined(__AVX512F__)
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = lo; i + 64 <= hi; i += 64) {
            if (pf) {
                _mm_prefetch((const char *)(p + i + pf), _MM_HINT_T0);
                _mm_prefetch((const char *)(p + i + pf + 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(p + i + pf + 32), _MM_HINT_T0);
                _mm_prefetch((const char *)(p + i + pf + 48), _MM_HINT_T0);
            }
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
        float s = 0.f;
        for (int64_t i = lo; i < hi; ++i) s += p[i];
        total += s;
#endif
    }
    return total;
}
"""


def probe_lib():
    d = tempfile.mkdtemp(prefix="gemv_stream_")
    src, so = os.path.join(d, "probe.c"), os.path.join(d, "probe.so")
    with open(src, "w") as f:
        f.write(PROBE_C)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", so], check=True)
    lib = ctypes.CDLL(so)
    lib.probe_read.restype = ctypes.c_float
    lib.probe_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    return lib


def bandwidth(threads: int, mib: int = 512, reps: int = 5) -> dict:
    lib = probe_lib()
    n = mib * 2 ** 20 // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    torch.set_num_threads(threads)
    dst.copy_(src)
    read, read_pf, copy = float("inf"), float("inf"), float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        lib.probe_read(src.data_ptr(), n, threads, 0)
        read = min(read, time.perf_counter() - t)
        t = time.perf_counter()
        lib.probe_read(src.data_ptr(), n, threads, 2048)
        read_pf = min(read_pf, time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - t)
    return {"threads": threads, "read_gbps": round(n * 4 / read / 1e9, 1),
            "read_pf_gbps": round(n * 4 / read_pf / 1e9, 1), "copy_gbps": round(n * 4 / copy / 1e9, 1)}


def weights(shapes, layers: int, kind: str) -> dict:
    """Per shape: `layers` packed weights (the head: one), as the kernels take them."""
    out = {}
    for name, k, n in shapes:
        np_, copies = -(-n // 32), 1 if name == "head" else layers
        if kind == "fp32":
            out[name] = [torch.full((np_ * 32 * k,), 0.01) for _ in range(copies)]
        else:
            kp = -(-k // 4) * 4
            out[name] = [(torch.ones(np_ * 32 * kp, dtype=torch.int8), torch.zeros(n, dtype=torch.int32),
                          torch.full((n,), 0.01)) for _ in range(copies)]
    return out


def caller(fn, kind: str, k: int, n: int, threads: int):
    """call(w): one 1-row GEMM against packed weight w, on preallocated buffers."""
    x = torch.randn(1, k)
    out = torch.empty(1, n)
    if kind == "fp32":
        return lambda w: fn.gemm(x.data_ptr(), 1, k, k, w.data_ptr(), n, None, out.data_ptr(), n, threads)
    kp = -(-k // 4) * 4
    aq, sa = torch.empty(1, kp, dtype=torch.uint8), torch.empty(1)

    def call(w):
        fn.quant_rows(x.data_ptr(), 1, k, k, aq.data_ptr(), kp, sa.data_ptr(), threads)
        fn.gemm_i8(aq.data_ptr(), 1, kp, sa.data_ptr(), w[0].data_ptr(), w[1].data_ptr(), w[2].data_ptr(), n,
                   None, out.data_ptr(), n, threads)
    return call


def nbytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in (w if isinstance(w, tuple) else (w,)))


def gemms(shapes, layers: int, kind: str, threads: int, rounds: int, with_step: bool) -> dict:
    fn = cpu_ext.load()
    ws = weights(shapes, layers, kind)
    calls = {name: caller(fn, kind, k, n, threads) for name, k, n in shapes}
    res = {}
    for name, k, n in shapes:
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for w in ws[name]:
                calls[name](w)
            best = min(best, (time.perf_counter() - t) / len(ws[name]))
        b = nbytes(ws[name][0])
        res[name] = {"K": k, "N": n, "us": round(best * 1e6, 1), "MB": round(b / 1e6, 2),
                     "gbps": round(b / best / 1e9, 1)}
    if with_step:
        order = [s for s in shapes if s[0] != "head"]
        total = sum(nbytes(ws[name][i]) for i in range(layers) for name, _, _ in order) + nbytes(ws["head"][0])
        best, best_layers = float("inf"), float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for i in range(layers):
                for name, _, _ in order:
                    calls[name](ws[name][i])
            t1 = time.perf_counter()
            calls["head"](ws["head"][0])
            t2 = time.perf_counter()
            best, best_layers = min(best, t2 - t), min(best_layers, t1 - t)
        res["step"] = {"ms": round(best * 1e3, 2), "layers_ms": round(best_layers * 1e3, 2),
                       "MB": round(total / 1e6, 1), "gbps": round(total / best / 1e9, 1)}
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--what", default="bw,fp32,int8,step")
    p.add_argument("--out")
    a = p.parse_args(argv)
    what = set(a.what.split(","))
    shapes, layers = SHAPES[a.shapes], a.layers or LAYERS[a.shapes]
    out = {"shapes": a.shapes, "layers": layers, "runs": []}
    for threads in (int(t) for t in a.threads.split(",")):
        run = {"threads": threads}
        if "bw" in what:
            run["bw"] = bandwidth(threads)
            print(f"threads {threads}: read {run['bw']['read_gbps']} GB/s (prefetching 8 KiB ahead "
                  f"{run['bw']['read_pf_gbps']} GB/s), copy {run['bw']['copy_gbps']} GB/s",
                  flush=True)
        for kind in ("fp32", "int8"):
            if kind not in what:
                continue
            run[kind] = r = gemms(shapes, layers, kind, threads, a.rounds, "step" in what)
            for name, c in r.items():
                if name == "step":
                    print(f"threads {threads} {kind} step: {c['ms']} ms ({c['layers_ms']} ms layers) for "
                          f"{c['MB']} MB = {c['gbps']} GB/s", flush=True)
                else:
                    print(f"threads {threads} {kind} {name:>8} K{c['K']} N{c['N']}: {c['us']:>8} us "
                          f"{c['MB']:>7} MB {c['gbps']:>6} GB/s", flush=True)
        out["runs"].append(run)
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
