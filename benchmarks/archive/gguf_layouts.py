"""A GGUF file's linear weights streamed as one 1-row decode step would, in each packed layout.

    python benchmarks/archive/gguf_layouts.py --gguf FILE [--reps 8] [--threads 2] [--out results.json]

Every 2-D tensor of the file except the token embeddings (a row gather, not a GEMM) is packed by
handler/model/quant_int4.py into three layouts of kernels/cpu_gemm_q4.c, all giving the same
weights bit for bit (tests/model/test_grouped_layouts.py):

  flat     fp32 scales and mins, 5/6/8-bit codes as bytes (the layout before the compact ones)
  compact  GGUF's two-level scales (K-quants) or fp16 ones (32-blocks), codes as bytes (the default)
  packed   compact scales, 5/6-bit codes as nibbles plus bit planes (option.grouped_code_layout=packed)
  act8     (with --act8, where the build has it) the compact layout times int8 activations
           (option.cpu_grouped_activations=int8: not the same results, kernels/cpu_gemm_q4.c's HAVE_Q_A8)

A step calls the 1-row GEMM over every tensor in file order (the weights, larger than the caches,
come from memory each time); the arms alternate within each repetition. Printed per arm: the bytes
streamed, the trimmed mean step time, and the bytes per second it implies.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.script_common import write_json  # noqa: E402
from handler.model import quant_formats as qf  # noqa: E402
from handler.model.quant_int4 import code_bits, pack  # noqa: E402
from kernels import cpu as cpu_ext  # noqa: E402


def layouts(w) -> dict:
    wide = code_bits(w, packed=False)
    return {"flat": pack(w, bits=wide, flat=True), "compact": pack(w, bits=wide),
            "packed": pack(w, bits=code_bits(w, packed=True))}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--act8", action="store_true",
                   help="add the int8-activation arm (option.cpu_grouped_activations=int8)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    from gguf import GGUFReader
    if not cpu_ext.gemm_q_available():
        print("error: kernels/cpu_gemm_q4.c does not run here", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    arms: dict[str, list] = {"flat": [], "compact": [], "packed": []}
    if a.act8 and not cpu_ext.q_act8_available():
        print("error: --act8: this build has no int8-activation path (avx512 with VNNI and VBMI, or avx2)", file=sys.stderr)
        return 2
    kinds: dict[str, int] = {}
    for t in GGUFReader(a.gguf).tensors:
        if t.name == "token_embd.weight" or len(t.shape) != 2 or t.tensor_type.name not in qf.GGUF_SERVED:
            continue
        k, n = (int(x) for x in t.shape)
        w = qf.gguf_blocks(t.tensor_type.name, t.data, n, k)
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + n * k
        for name, packed in layouts(w).items():
            arms[name].append((packed, n, torch.randn(1, k)))
    if a.act8:
        arms["act8"] = [(dataclasses.replace(p, act8=True), n, x) for p, n, x in arms["compact"]]
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(a.reps):
        for name, layers in arms.items():
            t0 = time.perf_counter()
            for packed, n, x in layers:
                cpu_ext.gemm_q(x, packed, n, None)
            times[name].append(time.perf_counter() - t0)
    res = {"gguf": os.path.basename(a.gguf), "threads": a.threads, "reps": a.reps, "isa": cpu_ext.backend().isa,
           "weights_by_kind": kinds, "arms": {}}
    for name, layers in arms.items():
        nbytes = sum(t.numel() * t.element_size() for packed, _, _ in layers for t in packed.tensors())
        ts = sorted(times[name])
        trimmed = ts[1:-1] if len(ts) > 2 else ts
        mean = sum(trimmed) / len(trimmed)
        res["arms"][name] = {"mbytes": round(nbytes / 1e6, 1), "step_ms": round(mean * 1e3, 2),
                             "gbps": round(nbytes / mean / 1e9, 2), "all_ms": [round(x * 1e3, 2) for x in times[name]]}
        print(f"{name:<8} {nbytes / 1e6:7.0f} MB  step {mean * 1e3:6.1f} ms  {nbytes / mean / 1e9:5.1f} GB/s", flush=True)
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
