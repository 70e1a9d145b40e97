"""Before/after of the panel GEMM on aliasing shapes: python gemm_ba.py LABEL (PYTHONPATH picks the tree)."""
import sys, time, torch
from kernels.cpu import linear as L
torch.manual_seed(0)
out = []
for n, k, m in ((768, 3072, 1024), (2048, 2048, 256), (4096, 2048, 64), (2048, 4096, 256), (1024, 4096, 16), (896, 4864, 256)):
    w = torch.randn(n, k); p = L.pack_panels(w); x = torch.randn(m, k)
    L.gemm(x, p, n, None)
    t0 = time.perf_counter()
    for _ in range(10): L.gemm(x, p, n, None)
    out.append(f"{n}x{k}@{m}:{2*m*n*k*10/(time.perf_counter()-t0)/1e9:.0f}")
print(sys.argv[1], " ".join(out), flush=True)
