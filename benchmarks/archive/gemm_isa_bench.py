"""The panel GEMMs of each kernel build this CPU runs (kernels/isa.py: avx512, avx2, neon) against each
other and against torch, at decode and prompt row counts, on SmolLM2-135M and Qwen2.5-0.5B weight shapes.

    python benchmarks/archive/gemm_isa_bench.py [--dtype fp32|bf16] [--isa avx512,avx2] [--rows 1,16,50,512]
        [--shapes smollm2,qwen2.5-0.5b] [--rounds 15] [--copies 4] [--no-torch] [--out FILE.json]

fp32: kernels/cpu_gemm.c (lmi_gemm); bf16: kernels/cpu_gemm_bf16.c's widened kernel (lmi_gemm_bf16w, bf16
weight, fp32 input, bf16 out), the kernel every build has. Beside them torch's F.linear and oneDNN's
prepacked linear (torch.ops.mkldnn._linear_pointwise, as OneDnnPack; absent where oneDNN refuses the
dtype on this CPU). torch runs at the ISA it chose at start-up: for an AVX2 comparison on an AVX-512
host, run with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 in the environment.

Each build is called through ctypes on preallocated buffers (no Python wrapper in the timing). Per
(K, N) shape, `copies` distinct weights are cycled so they stream from memory as a model's do; each
side's best single call over `rounds` rounds, the sides alternating within a round so a burst of
other load falls on all. GFLOP/s = 2 * rows * K * N / seconds; threads: torch.get_num_threads()
(OMP_NUM_THREADS).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import cpu as cpu_ext, isa  # noqa: E402
from kernels.cpu import lib as cpu_lib  # noqa: E402

SHAPES = {   # (K, N): q/o, k/v, gate/up, down
    "smollm2": [(576, 576), (576, 192), (576, 1536), (1536, 576)],
    "qwen2.5-0.5b": [(896, 896), (896, 128), (896, 4864), (4864, 896)],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--isa", default=",".join(isa.host_isas()), help="kernel builds, comma-separated")
    p.add_argument("--rows", default="1,16,50,512")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--no-torch", action="store_true", help="the kernel builds only")
    p.add_argument("--out")
    a = p.parse_args(argv)
    bf = a.dtype == "bf16"
    builds = [b for b in a.isa.split(",") if b]
    libs = {}
    for b in builds:
        fn = cpu_lib._load(b) if isa.runs(b) else None
        if fn is None or not (fn.gemm_bf16w_available if bf else fn.gemm_available):
            print(f"error: the {b} build's {'widened bf16' if bf else 'fp32'} panel GEMM does not run here "
                  f"(this CPU runs: {', '.join(isa.host_isas()) or 'none'})", file=sys.stderr)
            return 2
        libs[b] = fn
    threads = torch.get_num_threads()
    lin = torch.ops.mkldnn._linear_pointwise
    g = torch.Generator().manual_seed(0)
    print(f"threads {threads}, torch capability {torch.backends.cpu.get_cpu_capability()}, {a.dtype}", flush=True)
    results = []
    for shape in a.shapes.split(","):
        for k, n in SHAPES[shape]:
            ws = [torch.randn(n, k, generator=g) for _ in range(a.copies)]
            if bf:
                ws = [w.to(torch.bfloat16) for w in ws]
            packed = [cpu_ext.pack_bf16(w) if bf else cpu_ext.pack_panels(w) for w in ws]   # one layout for all builds
            onednn = None
            if not a.no_torch:
                try:
                    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
                except RuntimeError as e:
                    print(f"  (no oneDNN prepacked {a.dtype} here: {str(e).splitlines()[0]})", flush=True)
            for rows in [int(r) for r in a.rows.split(",")]:
                x = torch.randn(rows, k, generator=g)
                xt = x.to(torch.bfloat16) if bf else x          # torch's input
                xk = xt.float() if bf else x                    # the kernels' (fp32; bf16 values when bf16)
                outs = {b: torch.empty(rows, n, dtype=torch.bfloat16 if bf else torch.float32) for b in libs}

                def kernel(fn, out):
                    if bf:
                        return lambda i: fn.gemm_bf16w(xk.data_ptr(), rows, k, k, packed[i].data_ptr(), n, None,
                                                       out.data_ptr(), n, 1, threads)
                    return lambda i: fn.gemm(xk.data_ptr(), rows, k, k, packed[i].data_ptr(), n, None, out.data_ptr(),
                                             n, threads)

                sides = {b: kernel(fn, outs[b]) for b, fn in libs.items()}
                if not a.no_torch:
                    sides["torch"] = lambda i: torch.nn.functional.linear(xt, ws[i])
                    if onednn is not None:
                        sides["onednn"] = lambda i: lin(xt, onednn[i], None, "none", [], "")
                best = {s: float("inf") for s in sides}
                with torch.inference_mode():
                    for f in sides.values():
                        f(0)
                    for _ in range(a.rounds):
                        for s, f in sides.items():
                            for i in range(a.copies):
                                t = time.perf_counter()
                                f(i)
                                best[s] = min(best[s], time.perf_counter() - t)
                first = builds[0]
                same = all(torch.equal(outs[b], outs[first]) for b in builds)
                flops = 2 * rows * k * n
                row = {"shape": shape, "K": k, "N": n, "rows": rows, "builds_equal": same,
                       **{f"{s}_us": 1e6 * v for s, v in best.items()},
                       **{f"{s}_gflops": flops / v / 1e9 for s, v in best.items()}}
                results.append(row)
                print(f"K {k:5d} N {n:5d} rows {rows:4d}: GFLOP/s " + "  ".join(
                    f"{s} {row[f'{s}_gflops']:6.1f}" for s in sides) + ("" if same else "  BUILDS DIFFER"), flush=True)
                if not same:
                    return 1
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"threads": threads, "dtype": a.dtype, "builds": builds, "rounds": a.rounds, "copies": a.copies,
                       "torch_capability": torch.backends.cpu.get_cpu_capability(),
                       "env": {v: os.environ.get(v) for v in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")},
                       "results": results,
                       "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
