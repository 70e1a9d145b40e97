"""bf16 GEMMs of the CPU linear layers, interleaved, on a 135 M Llama's weight shapes: our bf16
panels by vdpbf16ps and widened in registers (kernels/cpu_gemm_bf16.c, Bf16PanelPack's two
modes), oneDNN's bf16 GEMM (prepacked, as OneDnnPack) and the fp32 panels over an fp32 copy
(kernels/cpu_gemm.c, PanelPack with widen: what a bf16 model used on an AVX-512 BF16 host
without AMX before kernels/cpu_gemm_bf16.c).

    python benchmarks/archive/gemm_bf16_bench.py [--rows 1,16,64,256,1024] [--rounds 5] [--copies 8]
        [--out benchmarks/results/bf16-panels/gemm.json]

Per (K, N) weight shape (576x576 q/o, 576x192 k/v, 576x1536 gate/up, 1536x576 down, 576x49152 the
output head) and row count: `copies` distinct weights of the shape run back to back (the head:
one), so the weights stream from memory as a model's do instead of sitting in L2; each side's
best of `rounds` rounds, the sides alternating within a round so a burst of other load falls on
all. Input and output bf16 (the fp32-copy side widens the input and rounds its output, as
PanelPack does). GFLOP/s = 2 * rows * K * N / seconds per weight; ratios: the other side's
time over the bf16 panels'.
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

from kernels import cpu as cpu_ext  # noqa: E402

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]   # (K, N)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64,256,1024")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not cpu_ext.gemm_bf16_available():
        print("error: kernels/cpu_gemm_bf16.c does not run here (it needs AVX512-BF16 and a C compiler)",
              file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    lin = torch.ops.mkldnn._linear_pointwise
    results = []
    for k, n in SHAPES:
        copies = 1 if n > 4096 else a.copies
        ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for _ in range(copies)]
        ours = [cpu_ext.pack_bf16(w) for w in ws]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        widened = [cpu_ext.pack_panels(w.float()) for w in ws]
        for rows in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            sides = {
                "bf16_panels": lambda: [cpu_ext.gemm_bf16(x, pk, n, None) for pk in ours],
                "bf16_in_registers": lambda: [cpu_ext.gemm_bf16(x, pk, n, None, widen=True) for pk in ours],
                "onednn_bf16": lambda: [lin(x, d, None, "none", [], "") for d in onednn],
                "widened_panels": lambda: [cpu_ext.gemm(x.float(), pk, n, None).to(torch.bfloat16)
                                           for pk in widened],
            }
            best = {name: float("inf") for name in sides}
            with torch.inference_mode():
                for f in sides.values():
                    f()
                for _ in range(a.rounds):
                    for name, f in sides.items():
                        t = time.perf_counter()
                        f()
                        best[name] = min(best[name], (time.perf_counter() - t) / copies)
            flops = 2 * rows * k * n
            row = {"K": k, "N": n, "rows": rows, **{f"{s}_us": 1e6 * v for s, v in best.items()},
                   **{f"{s}_gflops": flops / v / 1e9 for s, v in best.items()},
                   **{f"{s}_over_bf16_panels": best[s] / best["bf16_panels"] for s in sides}}
            results.append(row)
            print(f"K {k:5d} N {n:6d} rows {rows:5d}: GFLOP/s " + ", ".join(
                f"{s} {row[f'{s}_gflops']:6.1f}" for s in sides), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rounds": a.rounds, "copies": a.copies,
                       "results": results,
                       "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                   "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
