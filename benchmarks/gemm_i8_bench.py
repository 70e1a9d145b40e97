"""int8 GEMM (kernels/cpu_gemm_i8.c, option.quantize=int8) against the fp32 panel GEMM
(kernels/cpu_gemm.c) at the 135 M model's fused shapes, alternating, best of N calls each.

    python benchmarks/gemm_i8_bench.py [--threads 1] [--reps 30] [--out FILE.json]

GOP/s counts 2 x M x K x N per call (int8 multiply-adds for int8, FMAs for fp32); the int8 call
includes quantizing the activation rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from handler.model.cpu import prepack_linears  # noqa: E402
from handler.model.quant import quantize_model  # noqa: E402

# (K, N): q/k/v fused, gate/up fused, down, o_proj of SmolLM2-135M
SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 576)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rows", default="64,256")
    p.add_argument("--out")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    rows = []
    for k, n in SHAPES:
        for m in (int(x) for x in a.rows.split(",")):
            fp, i8 = nn.Linear(k, n, bias=False), nn.Linear(k, n, bias=False)
            i8.weight.data.copy_(fp.weight.data)
            prepack_linears(nn.Sequential(fp))
            quantize_model(nn.Sequential(i8), "int8")
            x = torch.randn(m, k)
            tf, ti = [], []
            with torch.no_grad():
                for _ in range(a.reps):
                    t = time.perf_counter(); fp(x); tf.append(time.perf_counter() - t)
                    t = time.perf_counter(); i8(x); ti.append(time.perf_counter() - t)
            ops = 2 * m * k * n
            r = {"K": k, "N": n, "M": m, "fp32_gflops": ops / min(tf) / 1e9, "int8_gops": ops / min(ti) / 1e9,
                 "ratio": min(tf) / min(ti)}
            rows.append(r)
            print(f"K{k} N{n} M{m}: fp32 {r['fp32_gflops']:.0f} GFLOP/s, int8 {r['int8_gops']:.0f} GOP/s, "
                  f"int8/fp32 {r['ratio']:.2f}x", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "reps": a.reps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
