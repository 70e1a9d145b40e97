"""Does streaming the weights from 2 MiB (transparent huge) pages speed a 1-row decode step?

    python benchmarks/archive/hugepages.py [--what read,fp32,wread,int8,w8,q4,q6] [--rounds 5] [--read-mib 1024]
        [--shapes qwen2.5-0.5b] [--layers 24] [--threads 2] [--out FILE.json]

Two arms hold the same bytes, allocated by kernels/cpu/'s empty_hugepage: `huge` (advised
MADV_HUGEPAGE before the first touch) and `4k` (advised MADV_NOHUGEPAGE), both filled before timing.
Arms alternate within each round (the order flips every round), and each round's figure is one pass:

read   benchmarks/archive/gemv_stream.py's 2-thread read loop of 512-bit loads over a `--read-mib` fp32
       buffer (best of 3 passes per round)
fp32   a whole step's fp32 1-row GEMMs (kernels/cpu_gemm.c's lmi_gemm; qkv, o, gate|up, down per
       layer, then the head), each layer's weights its own tensors, so they stream from memory
int8   the same through kernels/cpu_gemm_i8.c (quant_rows + gemm_i8)
w8     kernels/cpu_gemm_q4.c's 8-bit path with one group per row (W8A16, int8_weight_only): codes,
       scales and mins
q4     the same kernel's 4-bit path in groups of 32 (GGUF Q4_K / Q4_0, AWQ/GPTQ at g32), random codes
q6     its 8-bit path in groups of 16 (GGUF Q6_K, q4_k_m's head), random codes
wread  the read loop over fp32's tensors in the step's order, one call each (what the fp32 GEMMs
       would reach if they streamed as the plain loop does, call and size effects included)

Reports GB/s per round and arm, the median of each arm and huge/4k, and how much of each arm's
memory the kernel did place in huge pages (AnonHugePages over its mappings, /proc/self/smaps).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gemv_stream import LAYERS, SHAPES, caller, probe_lib  # noqa: E402
from kernels import cpu as cpu_ext  # noqa: E402
from benchmarks.script_common import write_json  # noqa: E402

ARMS = {"huge": True, "4k": False}
GROUPED = {"q4": (4, 32), "q6": (8, 16)}    # kind: (bits, group) of kernels/cpu_gemm_q4.c


def arm_weights(shapes, layers: int, kind: str, advise: bool) -> dict:
    """gemv_stream.weights' tensors, allocated by empty_hugepage (advised or not) and filled."""
    def full(n, dtype, value):
        t = cpu_ext.empty_hugepage((n,), dtype, advise=advise)
        t.fill_(value)
        return t

    def rand(n, dtype, scale):
        t = cpu_ext.empty_hugepage((n,), dtype, advise=advise)
        t.copy_(torch.randint(0, scale, (n,), dtype=dtype) if dtype == torch.uint8 else torch.rand(n) * scale)
        return t

    out = {}
    for name, k, n in shapes:
        np_, copies = -(-n // 32), 1 if name == "head" else layers
        if kind == "fp32":
            out[name] = [full(np_ * 32 * k, torch.float32, 0.01) for _ in range(copies)]
        elif kind == "w8":
            out[name] = [(full(np_ * 32 * k, torch.uint8, 0x87), full(np_ * 32, torch.float32, 0.01),
                          full(np_ * 32, torch.float32, -1.28)) for _ in range(copies)]
        elif kind in GROUPED:
            bits, group = GROUPED[kind]
            out[name] = [(rand(np_ * k * (16 if bits == 4 else 32), torch.uint8, 1 << bits),
                          rand(np_ * (k // group) * 32, torch.float32, 0.01),
                          rand(np_ * (k // group) * 32, torch.float32, -0.05)) for _ in range(copies)]
        else:
            kp = -(-k // 4) * 4
            out[name] = [(full(np_ * 32 * kp, torch.int8, 1), torch.zeros(n, dtype=torch.int32),
                          torch.full((n,), 0.01)) for _ in range(copies)]
    return out


def tensors(ws: dict):
    for lst in ws.values():
        for w in lst:
            yield from (w if isinstance(w, tuple) else (w,))


def placement(ts) -> dict:
    """The arm's bytes, and how much of its mappings the kernel placed in huge pages (AnonHugePages
    over Rss, /proc/self/smaps)."""
    p = cpu_ext.hugepage_placement(list(ts))
    return {"MB": round(p["bytes"] / 1e6, 1), "advised_MB": round(p["advised_bytes"] / 1e6, 1),
            "rss_MiB": round(p["rss_kib"] / 1024, 1), "huge_MiB": round(p["huge_kib"] / 1024, 1),
            "huge_share": round(p["huge_kib"] / p["rss_kib"], 3) if p["rss_kib"] else 0.0}


def step_fn(fn, shapes, layers: int, kind: str, threads: int, ws: dict):
    if kind == "wread":
        lib = probe_lib()

        def read(w):
            lib.probe_read(w.data_ptr(), w.numel(), threads, 0)
        calls = {name: read for name, _, _ in shapes}
    elif kind == "w8" or kind in GROUPED:
        bits, group = GROUPED.get(kind, (8, None))
        calls = {name: q_caller(fn, k, n, threads, bits, group or k) for name, k, n in shapes}
    else:
        calls = {name: caller(fn, kind, k, n, threads) for name, k, n in shapes}
    order = [s[0] for s in shapes if s[0] != "head"]

    def step():
        for i in range(layers):
            for name in order:
                calls[name](ws[name][i])
        calls["head"](ws["head"][0])
    return step


def q_caller(fn, k: int, n: int, threads: int, bits: int, group: int):
    """call((codes, scales, mins)): one 1-row kernels/cpu_gemm_q4.c GEMM on preallocated buffers
    (fp32 scales and mins: the layout's QS_F32)."""
    x, out = torch.randn(1, k), torch.empty(1, n)
    return lambda w: fn.gemm_q(x.data_ptr(), 1, k, k, w[0].data_ptr(), w[1].data_ptr(), w[2].data_ptr(), None, None,
                               cpu_ext.QS_F32, 1, bits, group, n, None, out.data_ptr(), n, 0, threads)


def summarise(rounds: list[dict], nbytes: float) -> dict:
    res = {"rounds_gbps": {a: [round(nbytes / r[a] / 1e9, 2) for r in rounds] for a in ARMS}}
    med = {a: statistics.median(r[a] for r in rounds) for a in ARMS}
    res["median_ms"] = {a: round(med[a] * 1e3, 3) for a in ARMS}
    res["median_gbps"] = {a: round(nbytes / med[a] / 1e9, 2) for a in ARMS}
    res["speedup_huge_over_4k"] = round(med["4k"] / med["huge"], 4)
    res["rounds_huge_faster"] = sum(r["huge"] < r["4k"] for r in rounds)
    return res


def run_read(threads: int, mib: int, rounds: int) -> dict:
    lib = probe_lib()
    n = mib * 2 ** 20 // 4
    bufs, fill_s = {}, {}
    for arm, advise in ARMS.items():
        t = time.perf_counter()
        bufs[arm] = cpu_ext.empty_hugepage((n,), torch.float32, advise=advise)
        bufs[arm].fill_(1.0)
        fill_s[arm] = round(time.perf_counter() - t, 3)
    per = []
    for r in range(rounds):
        row = {}
        for arm in (ARMS if r % 2 == 0 else reversed(list(ARMS))):
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                lib.probe_read(bufs[arm].data_ptr(), n, threads, 0)
                best = min(best, time.perf_counter() - t)
            row[arm] = best
        per.append(row)
    out = summarise(per, n * 4)
    out.update(MB=round(n * 4 / 1e6, 1), fill_s=fill_s, placement={a: placement([b]) for a, b in bufs.items()})
    return out


def run_step(kind: str, shapes, layers: int, threads: int, rounds: int) -> dict:
    fn = cpu_ext.load()
    ws, fill_s, steps = {}, {}, {}
    for arm, advise in ARMS.items():
        t = time.perf_counter()
        ws[arm] = arm_weights(shapes, layers, "fp32" if kind == "wread" else kind, advise)
        fill_s[arm] = round(time.perf_counter() - t, 3)
        steps[arm] = step_fn(fn, shapes, layers, kind, threads, ws[arm])
        steps[arm]()        # warm: first call's page walks, the kernels' thread pool
    nbytes = sum(t.numel() * t.element_size() for t in tensors(ws["huge"]))
    per = []
    for r in range(rounds):
        row = {}
        for arm in (ARMS if r % 2 == 0 else reversed(list(ARMS))):
            t = time.perf_counter()
            steps[arm]()
            row[arm] = time.perf_counter() - t
        per.append(row)
    out = summarise(per, nbytes)
    out.update(MB=round(nbytes / 1e6, 1), fill_s=fill_s,
               placement={a: placement(tensors(w)) for a, w in ws.items()})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", default="read,fp32,wread,int8,w8,q4,q6")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--read-mib", type=int, default=1024)
    p.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shapes, layers = SHAPES[a.shapes], a.layers or LAYERS[a.shapes]
    res = {"thp": cpu_ext.thp_mode(), "threads": a.threads, "rounds": a.rounds, "shapes": a.shapes,
           "layers": layers, "cpu": cpu_ext.backend().describe() if cpu_ext.backend() else None}
    for what in a.what.split(","):
        r = run_read(a.threads, a.read_mib, a.rounds) if what == "read" else \
            run_step(what, shapes, layers, a.threads, a.rounds)
        res[what] = r
        print(f"{what}: {r['MB']} MB; GB/s huge {r['median_gbps']['huge']} vs 4k {r['median_gbps']['4k']} "
              f"(x{r['speedup_huge_over_4k']}, huge faster in {r['rounds_huge_faster']}/{a.rounds} rounds; "
              f"rounds huge {r['rounds_gbps']['huge']} 4k {r['rounds_gbps']['4k']}); in huge pages: "
              f"huge {r['placement']['huge']['huge_share']:.0%}, 4k {r['placement']['4k']['huge_share']:.0%}; "
              f"fill s {r['fill_s']}", flush=True)
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
