"""The CPU linear layers' GEMM: oneDNN (prepacked, as OneDnnPack) against kernels/cpu_gemm.c
(PanelPack), on a 135 M Llama's weight shapes, interleaved.

    python benchmarks/archive/gemm_bench.py [--rows 1,8,16,36,50,64,128,256,512,1024] [--rounds 5]
        [--out benchmarks/results/gemm_bench.json]

Per row count: the 30 layers' seven projections (576x576 q and o, 192x576 k and v, 1536x576 gate
and up, 576x1536 down: 210 GEMMs, random fp32 weights) and the 49152x576 output head, each side's
best of `rounds` rounds, the two sides alternating within a round so a burst of other load falls
on both. GFLOP/s = 2 * rows * weights / seconds.
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

LAYERS, HIDDEN, INTER, KV, VOCAB = 30, 576, 1536, 192, 49152
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
          (HIDDEN, INTER)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,36,50,64,128,256,512,1024")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not cpu_ext.gemm_available():
        print("error: kernels/cpu_gemm.c does not run here (the torch backend, or no C compiler: see the warning above)", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for _ in range(LAYERS) for n, k in SHAPES]
    head = torch.randn(VOCAB, HIDDEN, generator=g)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    panels = [cpu_ext.pack_panels(w) for w in weights]
    head_d, head_p = torch.ops.mkldnn._reorder_linear_weight(head), cpu_ext.pack_panels(head)
    lin = torch.ops.mkldnn._linear_pointwise
    results = []
    for rows in [int(r) for r in a.rows.split(",")]:
        xs = {k: torch.randn(rows, k, generator=g) for k in (HIDDEN, INTER)}
        sides = {
            "onednn_layers": lambda: [lin(xs[w.shape[1]], d, None, "none", [], "") for w, d in zip(weights, onednn)],
            "panels_layers": lambda: [cpu_ext.gemm(xs[w.shape[1]], pk, w.shape[0], None)
                                      for w, pk in zip(weights, panels)],
            "onednn_head": lambda: lin(xs[HIDDEN], head_d, None, "none", [], ""),
            "panels_head": lambda: cpu_ext.gemm(xs[HIDDEN], head_p, VOCAB, None),
        }
        best = {name: float("inf") for name in sides}
        with torch.inference_mode():
            for f in sides.values():
                f()
            for _ in range(a.rounds):
                for name, f in sides.items():
                    t = time.perf_counter()
                    f()
                    best[name] = min(best[name], time.perf_counter() - t)
        flops = {"layers": 2 * rows * sum(w.numel() for w in weights), "head": 2 * rows * head.numel()}
        row = {"rows": rows, **{f"{k}_ms": 1e3 * v for k, v in best.items()}}
        for part in ("layers", "head"):
            row[f"{part}_onednn_over_panels"] = best[f"onednn_{part}"] / best[f"panels_{part}"]
            row[f"{part}_panels_gflops"] = flops[part] / best[f"panels_{part}"] / 1e9
            row[f"{part}_onednn_gflops"] = flops[part] / best[f"onednn_{part}"] / 1e9
        results.append(row)
        print(f"rows {rows:5d}: layers oneDNN {row['onednn_layers_ms']:7.1f} ms, panels {row['panels_layers_ms']:7.1f} ms "
              f"({row['layers_onednn_over_panels']:.2f}x); head oneDNN {row['onednn_head_ms']:6.1f} ms, "
              f"panels {row['panels_head_ms']:6.1f} ms ({row['head_onednn_over_panels']:.2f}x)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rounds": a.rounds, "results": results,
                       "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                   "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
