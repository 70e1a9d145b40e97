"""One client, the real model: decode speed with the fp32 RMSNorm in one C call
(kernels/cpu_exact.c, bit for bit torch's) against torch's own ops, interleaved in one process.

    python benchmarks/archive/rms_norm_ab.py [--quantize int8] [--pairs 4]

Prints each arm's output tokens/s and TPOT per pair (the pairs alternate the arms' order less
than the noise matters at 1 client; read the paired differences).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engine_loop import closed_loop, draw   # noqa: E402
from benchmarks.step_floor import make_engine          # noqa: E402
from kernels import cpu as cpu_ext                            # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default=".cache/models/smollm2")
    p.add_argument("--quantize", default=None)
    p.add_argument("--pairs", type=int, default=4)
    a = p.parse_args()
    eng = make_engine(a.model_dir, "fp32", 64, 12800, 4096, quantize=a.quantize)
    vocab = eng.tokenizer.vocab_size
    closed_loop(eng, draw(2, [60], [32], vocab, 1), 1)     # warm-up
    c_kernel = cpu_ext.rms_norm_f32
    arms = {"C kernel": c_kernel, "torch ops": lambda *args: None}
    tpot = {name: [] for name in arms}
    for k in range(a.pairs):
        for name, fn in arms.items():
            cpu_ext.rms_norm_f32 = fn
            r = closed_loop(eng, draw(4, [60], [48], vocab, 3 + k), 1)
            tpot[name].append(1000.0 / r["out_tok_per_s"])
    cpu_ext.rms_norm_f32 = c_kernel
    eng.shutdown()
    for name, v in tpot.items():
        print(f"{name:10s} ms per output token: " + " ".join(f"{x:.1f}" for x in v))
    d = [t - c for c, t in zip(tpot["C kernel"], tpot["torch ops"])]
    print(f"torch - C per pair: " + " ".join(f"{x:+.1f}" for x in d) + f" ms; C / torch median "
          f"{sorted(c / t for c, t in zip(tpot['C kernel'], tpot['torch ops']))[len(d) // 2]:.3f}")


if __name__ == "__main__":
    main()
