"""kernels/cpu_gemm_q4.c (grouped 4-bit weights, fp32 activations) against kernels/cpu_gemm.c (fp32
weights) on SmolLM2-135M's layer shapes, by row count: the kernel alone, no model.

    python benchmarks/gemm_q4_bench.py [--threads 1] [--rows 1,4,16,64,256] [--rounds 5] [--out F.json]

Each (shape, rows) cell alternates the two kernels for `rounds` rounds of 20 calls and keeps each one's
best round, timed in process CPU time (robust to other processes on a shared host; with --threads 1 it
is the kernel's own work). Random codes, group 64; both produce the same values (tests check it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from handler.model.quant_int4 import Grouped, pack  # noqa: E402
from kernels import cpu_ext  # noqa: E402

SHAPES = {"gate/up (576 -> 1536)": (1536, 576), "down (1536 -> 576)": (576, 1536), "q/o (576 -> 576)": (576, 576)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not (cpu_ext.gemm_q_available() and cpu_ext.gemm_available()):
        print("error: the C kernels are not available on this host (AVX-512F and a C compiler)", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    cells = []
    for name, (n, k) in SHAPES.items():
        g = k // a.group
        w = Grouped(torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8), torch.rand(n, g, generator=gen),
                    torch.rand(n, g, generator=gen), 4, a.group)
        panels, s, mn = pack(w)
        fp32 = cpu_ext.pack_panels(w.dequantize())
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            fns = {"q4": lambda: cpu_ext.gemm_q(x, panels, s, mn, 4, a.group, n, None),
                   "fp32": lambda: cpu_ext.gemm(x, fp32, n, None)}
            best = {key: float("inf") for key in fns}
            for _ in range(a.rounds):
                for key, fn in fns.items():
                    fn()
                    t = time.process_time()
                    for _ in range(20):
                        fn()
                    best[key] = min(best[key], (time.process_time() - t) / 20)
            cell = {"shape": name, "rows": m, "q4_us": round(best["q4"] * 1e6, 1),
                    "fp32_us": round(best["fp32"] * 1e6, 1), "q4_over_fp32": round(best["q4"] / best["fp32"], 3)}
            cells.append(cell)
            print(f"{name:<22} rows {m:>4}: q4 {cell['q4_us']:>8.1f} us, fp32 {cell['fp32_us']:>8.1f} us, "
                  f"q4/fp32 {cell['q4_over_fp32']:.2f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "group": a.group, "timing": "best of rounds, process CPU time",
                       "cells": cells, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
