"""A/B of one panel-GEMM source across two versions: the kernel's source as committed at `--base` against
the working tree's, both built for one instruction set (kernels/isa.py) with the flags the server's build
uses, called alternately on the same buffers; the outputs must be equal bit for bit.

    python benchmarks/archive/gemm_i8_ab.py [--kernel i8|fp32|bf16w] [--base HEAD] [--isa avx2]
        [--shapes 576x1536,896x4864] [--rows 1,4,8,16,50,512] [--rounds 5] [--calls 20] [--layers 1]
        [--quant-only] [--define NAME=VALUE] [--out FILE.json]

--kernel: i8 (kernels/cpu_gemm_i8.c: lmi_quant_rows + lmi_gemm_i8, the server's per-layer work;
--quant-only times lmi_quant_rows alone), fp32 (kernels/cpu_gemm.c: lmi_gemm), bf16w
(kernels/cpu_gemm_bf16.c: lmi_gemm_bf16w, bf16 weights, fp32 in and out). One thread (OMP_NUM_THREADS is
not read: each call passes nthreads=1), each
side's best round of `calls` calls by process CPU time (robust to other processes on a shared host),
the sides alternating within each round. `--layers L` cycles through L weight copies so they stream
from memory as a model's layers do. Ratio = base time / new time (above 1: the new source is faster).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from handler.model.quant import quantize_rows  # noqa: E402
from kernels import cpu as cpu_ext, isa  # noqa: E402
from kernels.cpu import build as cpu_build  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(src_text: str, target: list[str], out_dir: str, name: str, defines=()) -> ctypes.CDLL:
    src = os.path.join(out_dir, f"{name}.c")
    with open(src, "w") as f:
        f.write(src_text)
    so = os.path.join(out_dir, f"{name}.so")
    cmd = [cpu_build.compiler(), *cpu_build.EXACT_FLAGS, *target, *(f"-D{d}" for d in defines),
           "-I", os.path.join(ROOT, "kernels"), "-shared", src, "-o", so, "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: building {name} failed: {r.stderr[-2000:]}")
    lib = ctypes.CDLL(so)
    i64, p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for name, args in (("lmi_pack_i8", [p, i64, i64, p, p]), ("lmi_quant_rows", [p, i64, i64, i64, p, i64, p, c_int]),
                       ("lmi_gemm_i8", [p, i64, i64, p, p, p, p, i64, p, p, i64, c_int]),
                       ("lmi_pack_b", [p, i64, i64, p]), ("lmi_gemm", [p, i64, i64, i64, p, i64, p, p, i64, c_int]),
                       ("lmi_pack_bf16", [p, i64, i64, p]),
                       ("lmi_gemm_bf16w", [p, i64, i64, i64, p, i64, p, p, i64, c_int, c_int])):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = args
    return lib


SOURCES = {"i8": "kernels/cpu_gemm_i8.c", "fp32": "kernels/cpu_gemm.c", "bf16w": "kernels/cpu_gemm_bf16.c"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--isa", default="avx2")
    ap.add_argument("--kernel", choices=list(SOURCES), default="i8")
    ap.add_argument("--shapes", default="576x1536,896x4864", help="KxN, comma-separated")
    ap.add_argument("--rows", default="1,4,8,16,50,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--quant-only", action="store_true")
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE for the working tree's build only (a compile-time variant), repeatable")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not isa.runs(a.isa):
        print(f"error: this CPU cannot run the {a.isa} build (it runs: {', '.join(isa.host_isas())})", file=sys.stderr)
        return 2
    a.source = SOURCES[a.kernel]
    base_text = subprocess.run(["git", "-C", ROOT, "show", f"{a.base}:{a.source}"], capture_output=True, text=True,
                               check=True).stdout
    with open(os.path.join(ROOT, a.source)) as f:
        new_text = f.read()
    target = isa.compile_flags(a.isa)
    tmp = tempfile.mkdtemp(prefix="lmi_ab_")
    try:
        libs = {"base": build(base_text, target, tmp, "base"), "new": build(new_text, target, tmp, "new", a.define)}
    finally:     # loaded libraries stay mapped once their files are gone
        shutil.rmtree(tmp, ignore_errors=True)
    clock = time.process_time
    cells = []
    print(f"{a.source} {a.isa} ({' '.join(target)}): base {a.base} vs working tree; 1 thread, best of {a.rounds} "
          f"rounds x {a.calls} calls, process CPU time", flush=True)
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        kp = -(-k // 4) * 4
        g = torch.Generator().manual_seed(0)
        ws = []
        for _ in range(a.layers):
            w = torch.randn(n, k, generator=g) * 0.05
            qw, sw = quantize_rows(w)
            ws.append((qw.contiguous(), sw, w, w.to(torch.bfloat16)))
        packed = {}
        for side, lib in libs.items():     # each build packs its own panels (the layout is the build's)
            packed[side] = []
            for qw, sw, w, wb in ws:
                if a.kernel == "i8":
                    panels = torch.empty(-(-n // 32) * 32 * kp, dtype=torch.int8)
                    wsum = torch.empty(n, dtype=torch.int32)
                    lib.lmi_pack_i8(qw.data_ptr(), n, k, panels.data_ptr(), wsum.data_ptr())
                elif a.kernel == "fp32":
                    panels, wsum = torch.empty(-(-n // 32) * 32 * k), None
                    lib.lmi_pack_b(w.data_ptr(), n, k, panels.data_ptr())
                else:
                    panels, wsum = torch.empty(-(-n // 32) * 32 * (k + k % 2), dtype=torch.bfloat16), None
                    lib.lmi_pack_bf16(wb.data_ptr(), n, k, panels.data_ptr())
                packed[side].append((panels, wsum, sw))
        bias = torch.randn(n, generator=g)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            x[:, 3] *= 20
            bufs = {s: (torch.empty(m, kp, dtype=torch.uint8), torch.empty(m), torch.empty(m, n)) for s in libs}

            def call(side, i):
                lib, (aq, sa, out) = libs[side], bufs[side]
                if a.kernel == "fp32":
                    lib.lmi_gemm(x.data_ptr(), m, k, k, packed[side][i % a.layers][0].data_ptr(), n, bias.data_ptr(),
                                 out.data_ptr(), n, 1)
                    return
                if a.kernel == "bf16w":
                    lib.lmi_gemm_bf16w(x.data_ptr(), m, k, k, packed[side][i % a.layers][0].data_ptr(), n,
                                       bias.data_ptr(), out.data_ptr(), n, 0, 1)
                    return
                lib.lmi_quant_rows(x.data_ptr(), m, k, k, aq.data_ptr(), kp, sa.data_ptr(), 1)
                if not a.quant_only:
                    panels, wsum, sw = packed[side][i % a.layers]
                    lib.lmi_gemm_i8(aq.data_ptr(), m, kp, sa.data_ptr(), panels.data_ptr(), wsum.data_ptr(),
                                    sw.data_ptr(), n, bias.data_ptr(), out.data_ptr(), n, 1)
            for s in libs:
                call(s, 0)
            same = all(torch.equal(bufs["base"][j], bufs["new"][j])
                       for j in ((0, 1) if a.quant_only else (2,) if a.kernel != "i8" else (0, 1, 2)))
            best = {s: float("inf") for s in libs}
            for _ in range(a.rounds):
                for s in libs:
                    t = clock()
                    for i in range(a.calls):
                        call(s, i)
                    best[s] = min(best[s], (clock() - t) / a.calls)
            ratio = best["base"] / best["new"]
            ops = 2 * m * k * n
            cell = {"K": k, "N": n, "M": m, "base_us": round(best["base"] * 1e6, 1),
                    "new_us": round(best["new"] * 1e6, 1), "base_over_new": round(ratio, 2), "equal": same,
                    "new_gops": round(ops / best["new"] / 1e9, 1)}
            cells.append(cell)
            print(f"K{k:<5} N{n:<5} M{m:<4}: base {cell['base_us']:>9.1f} us  new {cell['new_us']:>9.1f} us "
                  f"({cell['new_gops']:>5.0f} GOP/s)  base/new {ratio:.2f}" + ("" if same else "  OUTPUTS DIFFER"),
                  flush=True)
            if not same:
                return 1
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"isa": a.isa, "base": a.base, "kernel": a.kernel, "source": a.source, "rounds": a.rounds,
                       "calls": a.calls,
                       "layers": a.layers, "quant_only": a.quant_only, "cells": cells,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
