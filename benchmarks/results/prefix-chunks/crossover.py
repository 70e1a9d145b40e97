"""One layer's attention for a prompt chunk of n rows after c cached rows, two ways on this build's C kernels:
row by row (n decode rows over the pool, contexts c+1 .. c+n: what runner.pack_step's rowwise_keys packs) and
as one sequence (lmi_prefill_attention reading the c earlier keys from the pool). Median of 30 calls each,
alternated. Prints the ratio rows / sequence per (heads, c, n) and the row-keys n*c + n(n+1)/2.

    .venv/bin/python benchmarks/results/prefix-chunks/crossover.py
"""
import statistics
import time

import torch

from kernels import cpu as cpu_ext
from kernels import pool as kv_pool

torch.manual_seed(0)
BS = 16


def case(h, hkv, d, c, n):
    total = c + n
    nblk = -(-total // BS)
    kp, vp = (kv_pool.allocate((nblk + 1, BS, hkv, d), torch.float32, head_major=True) for _ in "kv")
    k, v = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
    table = torch.arange(nblk, dtype=torch.int32)
    cpu_ext.write_kv(kp, vp, k, v, torch.arange(total))
    q = torch.randn(n, h, d)
    out = torch.empty(n, h, d)
    rows_t = table.repeat(n, 1).contiguous()
    rows_l = torch.arange(c + 1, c + n + 1, dtype=torch.int32)
    kk, vv = k[c:].contiguous(), v[c:].contiguous()

    def rows():
        cpu_ext.decode_attention(q, kp, vp, rows_t, rows_l, d ** -0.5)

    def seq():
        assert cpu_ext.prefill_attention(q, kk, vv, [0], [n], d ** -0.5, out, (kp, vp, table[None], [c]))
    ta, tb = [], []
    for _ in range(30):
        for f, acc in ((rows, ta), (seq, tb)):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


print(f"threads {torch.get_num_threads()}")
print("heads  c      n    row-keys   rows us   seq us   rows/seq")
for h, hkv in ((9, 3), (14, 2)):
    for c in (64, 256, 1024, 4096):
        for n in (2, 4, 8, 16, 32, 64, 128):
            a, b = case(h, hkv, 64, c, n)
            print(f"{h}/{hkv}  {c:5d} {n:4d} {n * c + n * (n + 1) // 2:9d} {a * 1e6:9.0f} {b * 1e6:8.0f} {a / b:9.2f}",
                  flush=True)
