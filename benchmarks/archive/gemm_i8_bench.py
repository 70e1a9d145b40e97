"""int8 GEMM (kernels/cpu_gemm_i8.c, option.quantize=int8) against the fp32 panel GEMM (kernels/cpu_gemm.c) of
the same kernel build, for each build this CPU runs (avx512, avx2: kernels/isa.py), by row count.

    python benchmarks/archive/gemm_i8_bench.py [--isa avx512,avx2] [--shapes smollm2,qwen2.5-0.5b] [--rows 1,16,50,512]
                                       [--threads 1] [--rounds 5] [--calls 20] [--layers 1] [--out FILE.json]

Each (build, shape, rows) cell alternates the two kernels for `rounds` rounds of `calls` calls and keeps each
one's best round: process CPU time with one thread (robust to other processes on a shared host), wall time
with more. The kernels are called through ctypes on preallocated buffers (the kernel's time, not the Python
wrapper's); the int8 call includes quantizing the activation rows (lmi_quant_rows), as the server's does.
`--layers L` cycles through L copies of each weight, one per call, as a model's step does through its layers:
with enough of them the weights stream from memory instead of staying in the caches (1: one hot weight).
GOP/s counts 2 x M x K x N per call. The last lines compare the builds: each kernel's time in the other
build over its time in the first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from handler.model.quant import quantize_rows  # noqa: E402
from kernels import cpu as cpu_ext, isa  # noqa: E402
from kernels.cpu import build as cpu_build  # noqa: E402

# (K, N) of one linear layer: the MLP's gate (or up) projection of each model
SHAPES = {"smollm2": [(576, 1536)], "qwen2.5-0.5b": [(896, 4864)],
          # SmolLM2-135M's fused layers: q/k/v, gate/up, down, o_proj
          "smollm2-fused": [(576, 960), (576, 3072), (1536, 576), (576, 576)]}


def best_of(fns: dict, rounds: int, calls: int, clock) -> dict:
    """Each callable's best mean time per call over `rounds` rounds of `calls` calls, the callables
    alternating within a round."""
    best = {key: float("inf") for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            fn(0)
            t = clock()
            for i in range(calls):
                fn(i)
            best[key] = min(best[key], (clock() - t) / calls)
    return best


def kernels(x: torch.Tensor, layers: list, n: int, threads: int) -> dict:
    """The two kernels as the library runs them for x (ctypes calls on preallocated buffers, no Python
    wrapper around them): call i uses layer i % len(layers)."""
    fn = cpu_ext.load()
    m, k = x.shape
    kp = -(-k // 4) * 4
    aq, sa, out = torch.empty(m, kp, dtype=torch.uint8), torch.empty(m), torch.empty(m, n)
    ptrs = [(p.data_ptr(), ws.data_ptr(), sw.data_ptr(), f.data_ptr()) for p, ws, sw, f in layers]

    def int8(i):
        p, ws, sw, _ = ptrs[i % len(ptrs)]
        fn.quant_rows(x.data_ptr(), m, k, k, aq.data_ptr(), kp, sa.data_ptr(), threads)
        fn.gemm_i8(aq.data_ptr(), m, kp, sa.data_ptr(), p, ws, sw, n, None, out.data_ptr(), n, threads)

    def fp32(i):
        fn.gemm(x.data_ptr(), m, k, k, ptrs[i % len(ptrs)][3], n, None, out.data_ptr(), n, threads)
    return {"int8": int8, "fp32": fp32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", default=",".join(isa.host_isas()), help="kernel builds, comma-separated")
    p.add_argument("--shapes", default="smollm2,qwen2.5-0.5b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,16,50,512")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args(argv)
    builds = [b for b in a.isa.split(",") if b]
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.threads == 1 else time.perf_counter
    cells = []
    for build in builds:
        cpu_ext.select(build)
        if not (cpu_ext.gemm_i8_available() and cpu_ext.gemm_available()):
            print(f"error: the {build} build has no int8 or fp32 panel GEMM here", file=sys.stderr)
            return 2
        for shape in a.shapes.split(","):
            for k, n in SHAPES[shape]:
                gen = torch.Generator().manual_seed(0)
                layers = []
                for _ in range(a.layers):
                    w = torch.randn(n, k, generator=gen) * 0.05
                    qw, sw = quantize_rows(w)
                    panels, wsum = cpu_ext.pack_i8(qw)
                    layers.append((panels, wsum, sw, cpu_ext.pack_panels(w)))
                for m in (int(r) for r in a.rows.split(",")):
                    x = torch.randn(m, k, generator=gen)
                    fns = kernels(x, layers, n, a.threads)
                    best = best_of(fns, a.rounds, a.calls, clock)
                    ops = 2 * m * k * n
                    cell = {"isa": build, "shape": shape, "K": k, "N": n, "M": m,
                            "int8_us": round(best["int8"] * 1e6, 1), "fp32_us": round(best["fp32"] * 1e6, 1),
                            "int8_gops": round(ops / best["int8"] / 1e9, 1),
                            "fp32_gflops": round(ops / best["fp32"] / 1e9, 1),
                            "fp32_over_int8": round(best["fp32"] / best["int8"], 2)}
                    cells.append(cell)
                    print(f"{build:<6} K{k} N{n} M{m:<4}: int8 {cell['int8_us']:>9.1f} us ({cell['int8_gops']:>5.0f} GOP/s), "
                          f"fp32 {cell['fp32_us']:>9.1f} us ({cell['fp32_gflops']:>5.0f} GFLOP/s), "
                          f"int8 {cell['fp32_over_int8']:.2f}x fp32's speed", flush=True)
    cpu_ext.select(None)
    if len(builds) > 1:
        first = {(c["K"], c["N"], c["M"]): c for c in cells if c["isa"] == builds[0]}
        for c in cells:
            f = first.get((c["K"], c["N"], c["M"]))
            if c["isa"] != builds[0] and f:
                c["int8_time_vs_" + builds[0]] = round(c["int8_us"] / f["int8_us"], 2)
                c["fp32_time_vs_" + builds[0]] = round(c["fp32_us"] / f["fp32_us"], 2)
                print(f"{c['isa']} / {builds[0]} time, K{c['K']} N{c['N']} M{c['M']}: int8 "
                      f"{c['int8_time_vs_' + builds[0]]:.2f}, fp32 {c['fp32_time_vs_' + builds[0]]:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "rounds": a.rounds, "calls": a.calls, "layers": a.layers,
                       "timing": "best round, " + ("process CPU time" if a.threads == 1 else "wall time"),
                       "cpu": next((ln.split(":", 1)[1].strip() for ln in cpu_build.cpu_signature().splitlines()
                                if ln.startswith("model name")), ""), "cells": cells,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
