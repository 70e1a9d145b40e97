"""One grouped-weight GEMM (kernels/cpu_gemm_q4.c) of a GGUF type, timed per code layout and activation format.

    python benchmarks/grouped_gemm.py [--kinds Q6_K,Q5_K] [--n 151936] [--k 2048] [--rows 1,4]
        [--builds avx512,avx2] [--reps 9] [--threads 2] [--out results.json]

The default shape is a Qwen2.5 1.5B / 3B output head (151,936 x 2,048; a llama.cpp q4_k_m file stores it as
Q6_K). The weight is random GGUF blocks (random codes and sub-scales, small fp16 superblock scales: the
kernels' time does not depend on the values) read by handler/model/quant_formats.py as a file's would be,
and packed by handler/model/quant_int4.py (GGUF's two-level scales, QS_I8, for the K-quants). Per kind,
build and row count, the arms alternate within each repetition:

  exact bytes / exact packed   fp32 activations (option.cpu_grouped_activations=exact), codes one a byte or
                               at their width (option.grouped_code_layout=bytes / packed)
  int8 bytes / int8 packed     int8 activations (option.cpu_grouped_activations=int8), where the build has them

(4- and 8-bit kinds have one layout.) Printed: the median ms a call and the weight bytes a second it implies.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.script_common import write_json  # noqa: E402
from handler.model import quant_formats as qf  # noqa: E402
from handler.model.quant_int4 import pack  # noqa: E402
from kernels import cpu as cpu_ext  # noqa: E402

# GGUF block: (elements, bytes, the offsets of its fp16 scale fields)
BLOCKS = {"Q4_0": (32, 18, [0]), "Q4_1": (32, 20, [0, 2]), "Q5_0": (32, 22, [0]), "Q5_1": (32, 24, [0, 2]),
          "Q8_0": (32, 34, [0]), "Q4_K": (256, 144, [0, 2]), "Q5_K": (256, 176, [0, 2]), "Q6_K": (256, 210, [208])}


def weight(kind: str, n: int, k: int, seed: int = 0):
    """A random [n, k] weight of GGUF type `kind`, as handler/model/quant_formats.py reads a file's."""
    elems, size, scales = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for off in scales:
        raw[..., off:off + 2] = (rng.random((n, k // elems, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    return qf.gguf_blocks(kind, raw.reshape(n, -1), n, k)


def arms(w, act8: bool) -> dict:
    out = {}
    for layout in ("bytes", "packed"):
        p = pack(w, packed=layout == "packed")
        if any(q.bits == p.bits for q in out.values()):
            continue                                   # 4/8-bit kinds: one layout
        out[f"exact {layout} ({p.bits}-bit)"] = p
    if act8:
        out.update({name.replace("exact", "int8"): dataclasses.replace(p, act8=True) for name, p in list(out.items())})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="Q6_K,Q5_K", help=f"comma-separated, of {', '.join(BLOCKS)}")
    ap.add_argument("--n", type=int, default=151936)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--builds", default="", help="kernels/isa.py builds (default: this host's default)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    builds = [b for b in a.builds.split(",") if b] or [None]
    res = {"n": a.n, "k": a.k, "threads": a.threads, "reps": a.reps, "cpu": _cpu(), "results": []}
    print(f"| kind | build | rows | arm | MB | ms (median of {a.reps}) | GB/s |\n|---|---|---:|---|---:|---:|---:|")
    for kind in a.kinds.split(","):
        w = weight(kind, a.n, a.k)
        for build in builds:
            cpu_ext.select(build)
            if not cpu_ext.gemm_q_available():
                print(f"error: kernels/cpu_gemm_q4.c does not run on the {build or 'default'} build", file=sys.stderr)
                return 2
            packs = arms(w, cpu_ext.q_act8_available())
            for m in (int(r) for r in a.rows.split(",")):
                x = torch.randn(m, a.k, generator=torch.Generator().manual_seed(m))
                times = {name: [] for name in packs}
                for name, p in packs.items():                     # warm: pages touched, code built
                    cpu_ext.gemm_q(x, p, a.n, None)
                for _ in range(a.reps):
                    for name, p in packs.items():
                        t0 = time.perf_counter()
                        cpu_ext.gemm_q(x, p, a.n, None)
                        times[name].append(time.perf_counter() - t0)
                for name, p in packs.items():
                    nbytes = sum(t.numel() * t.element_size() for t in p.tensors())
                    ms = statistics.median(times[name]) * 1e3
                    isa = cpu_ext.backend().isa
                    print(f"| {kind} | {isa} | {m} | {name} | {nbytes / 1e6:.0f} | {ms:.2f} "
                          f"| {nbytes / ms / 1e6:.1f} |", flush=True)
                    res["results"].append({"kind": kind, "build": isa, "rows": m, "arm": name, "mbytes": nbytes / 1e6,
                                           "ms": ms, "all_ms": [t * 1e3 for t in times[name]]})
        del w
    cpu_ext.select(None)
    write_json(a.out, res)
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
