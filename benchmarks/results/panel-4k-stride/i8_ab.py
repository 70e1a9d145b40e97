# int8 W8A8 GEMM (kernels/cpu_gemm_i8.c) best of 7 per shape: python i8_ab.py LABEL (PYTHONPATH: the tree under test;
# SEL=avx2 picks that build; SHAPES=MxKxN,...)
import sys, time, torch
from kernels import cpu as cpu_ext
from handler.model import quant
import os
if os.environ.get("SEL"): cpu_ext.select(os.environ["SEL"]); print("widened", cpu_ext.load().lmi_arch_i8_widened() if hasattr(cpu_ext.load(), "lmi_arch_i8_widened") else "?")
torch.manual_seed(0)
res = {}
for (m, k, n) in [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "64x4096x4096,256x4096x4096,256x4096x1024,256x4000x4096").split(",")]:
    w = torch.randn(n, k) * 0.05
    qw, sw = quant.quantize_rows(w)
    panels, wsum = cpu_ext.pack_i8(qw)
    x = torch.randn(m, k)
    cpu_ext.gemm_i8(x, panels, wsum, sw, n, None)
    best = 1e9
    for _ in range(7):
        t = time.perf_counter(); cpu_ext.gemm_i8(x, panels, wsum, sw, n, None); best = min(best, time.perf_counter() - t)
    print(f"{sys.argv[1]} M={m} K={k} N={n}: {best*1e3:.2f} ms {2*m*k*n/best/1e9:.0f} GOP/s", flush=True)
