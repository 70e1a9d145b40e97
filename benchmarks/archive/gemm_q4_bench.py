"""kernels/cpu_gemm_q4.c (grouped 4-bit weights, fp32 activations) against kernels/cpu_gemm.c (fp32 weights)
of the same kernel build, for each build this CPU runs (avx512, avx2: kernels/isa.py), by row count: the
kernels alone, no model.

    python benchmarks/archive/gemm_q4_bench.py [--isa avx512,avx2] [--shapes smollm2,qwen2.5-0.5b] [--rows 1,16,50,512]
                                       [--threads 1] [--rounds 5] [--calls 20] [--layers 1] [--group 64]
                                       [--bits 4] [--out F.json]

Each (build, shape, rows) cell alternates the two kernels for `rounds` rounds of `calls` calls and keeps each
one's best round: process CPU time with one thread (robust to other processes on a shared host), wall time
with more. The kernels are called through ctypes on preallocated buffers (the kernel's time, not the Python
wrapper's). `--layers L` cycles through L copies of each weight, one per call, as a model's step does
through its layers: with enough of them the weights stream from memory instead of staying in the caches.
Random codes; both kernels produce the same values (tests/model/test_quant_int4.py checks it). The last
lines compare the builds: each kernel's time in the other build over its time in the first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gemm_i8_bench import SHAPES, best_of  # noqa: E402
from handler.model.quant_int4 import Grouped, pack  # noqa: E402
from kernels import cpu as cpu_ext, isa  # noqa: E402
from kernels.cpu import build as cpu_build  # noqa: E402


def kernels(x: torch.Tensor, layers: list, n: int, bits: int, group: int, threads: int) -> dict:
    """The two kernels for x as ctypes calls on preallocated buffers; call i uses layer i % len(layers)."""
    fn = cpu_ext.load()
    m, k = x.shape
    out = torch.empty(m, n)

    def q(i):
        w = layers[i % len(layers)][0]
        fn.gemm_q(x.data_ptr(), m, k, k, w.codes.data_ptr(), w.s.data_ptr(), w.m.data_ptr(), None, None, w.smode,
                  w.sg, w.bits, w.group, n, None, out.data_ptr(), n, int(w.act8), threads)

    def fp32(i):
        fn.gemm(x.data_ptr(), m, k, k, layers[i % len(layers)][1].data_ptr(), n, None, out.data_ptr(), n, threads)
    return {"q": q, "fp32": fp32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", default=",".join(isa.host_isas()), help="kernel builds, comma-separated")
    p.add_argument("--shapes", default="smollm2,qwen2.5-0.5b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,16,50,512")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--out")
    a = p.parse_args(argv)
    builds = [b for b in a.isa.split(",") if b]
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.threads == 1 else time.perf_counter
    q = f"q{a.bits}"
    cells = []
    for build in builds:
        cpu_ext.select(build)
        if not (cpu_ext.gemm_q_available() and cpu_ext.gemm_available()):
            print(f"error: the {build} build has no grouped-weight or fp32 panel GEMM here", file=sys.stderr)
            return 2
        for shape in a.shapes.split(","):
            for k, n in SHAPES[shape]:
                gen = torch.Generator().manual_seed(0)
                layers = []
                for _ in range(a.layers):
                    g = -(-k // a.group)
                    w = Grouped(torch.randint(0, 2 ** a.bits, (n, k), generator=gen).to(torch.uint8),
                                torch.rand(n, g, generator=gen), torch.rand(n, g, generator=gen), a.bits, a.group)
                    layers.append((pack(w), cpu_ext.pack_panels(w.dequantize())))
                for m in (int(r) for r in a.rows.split(",")):
                    x = torch.randn(m, k, generator=gen)
                    best = best_of(kernels(x, layers, n, a.bits, a.group, a.threads), a.rounds, a.calls, clock)
                    cell = {"isa": build, "shape": shape, "K": k, "N": n, "M": m,
                            f"{q}_us": round(best["q"] * 1e6, 1), "fp32_us": round(best["fp32"] * 1e6, 1),
                            f"fp32_over_{q}": round(best["fp32"] / best["q"], 2)}
                    cells.append(cell)
                    print(f"{build:<6} K{k} N{n} M{m:<4}: {q} {cell[q + '_us']:>9.1f} us, fp32 {cell['fp32_us']:>9.1f} us, "
                          f"{q} {cell['fp32_over_' + q]:.2f}x fp32's speed", flush=True)
    cpu_ext.select(None)
    if len(builds) > 1:
        first = {(c["K"], c["N"], c["M"]): c for c in cells if c["isa"] == builds[0]}
        for c in cells:
            f = first.get((c["K"], c["N"], c["M"]))
            if c["isa"] != builds[0] and f:
                c[f"{q}_time_vs_{builds[0]}"] = round(c[q + "_us"] / f[q + "_us"], 2)
                c[f"fp32_time_vs_{builds[0]}"] = round(c["fp32_us"] / f["fp32_us"], 2)
                print(f"{c['isa']} / {builds[0]} time, K{c['K']} N{c['N']} M{c['M']}: {q} "
                      f"{c[f'{q}_time_vs_{builds[0]}']:.2f}, fp32 {c[f'fp32_time_vs_{builds[0]}']:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "rounds": a.rounds, "calls": a.calls, "layers": a.layers,
                       "group": a.group, "bits": a.bits,
                       "timing": "best round, " + ("process CPU time" if a.threads == 1 else "wall time"),
                       "cpu": next((ln.split(":", 1)[1].strip() for ln in cpu_build.cpu_signature().splitlines()
                                    if ln.startswith("model name")), ""),
                       "cells": cells, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
