"""A CPU decode step three ways, in one process, alternating.

    python benchmarks/archive/decode_step_ab.py --model-dir DIR [--dtype fp32|bf16] [--quantize int8]
        [--rows 1] [--rounds 8] [--steps 20]

stack: the whole decoder stack in one C call (handler/model/cpu_stack.py, kernels/cpu_layer.c).
fused: the Python layers, with a decode step's rotary, KV write and attention in one C call per
layer (the CPU backend's `cpu_ext.decode_fused`, kernels/backends.py). unfused: that switched off
too (it returns None), the backend takes rotary + write_kv + attention. The arms run the same engine and sequences: `rows`
requests decode together, `steps` iterations per arm, `rounds` alternations; medians per step and
their ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import cpu as cpu_ext  # noqa: E402
from benchmarks.step_floor import make_engine  # noqa: E402
from handler.engine.request import SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--quantize")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    engine = make_engine(a.model_dir, a.dtype, max(a.rows, 4), 8192, quantize=a.quantize)
    total = 10 + 3 * a.rounds * a.steps + 8
    engine.submit([list(range(100 + i, 160 + i)) for i in range(a.rows)],
                  SamplingParams(max_new_tokens=total, ignore_eos=True))
    for _ in range(10):    # the prompts' prefill and a few decode steps
        engine.step()
    real = cpu_ext.decode_fused
    model = engine.runner.model
    stack = model.decode_stack
    times = {"stack": [], "fused": [], "unfused": []} if stack is not None else {"fused": [], "unfused": []}
    try:
        for _ in range(a.rounds):
            for arm in times:
                cpu_ext.decode_fused = real if arm != "unfused" else (lambda *args, **kw: None)
                model.decode_stack = stack if arm == "stack" else None
                t = time.perf_counter()
                for _ in range(a.steps):
                    engine.step()
                times[arm].append((time.perf_counter() - t) / a.steps * 1e3)
    finally:
        cpu_ext.decode_fused, model.decode_stack = real, stack
    for arm, v in times.items():
        print(f"{arm:8s} median {statistics.median(v):6.2f} ms/step  " + " ".join(f"{x:.1f}" for x in v))
    med = {arm: statistics.median(v) for arm, v in times.items()}
    what = f"({a.dtype}{', ' + a.quantize if a.quantize else ''}, {a.rows} rows)"
    print(f"unfused / fused: {med['unfused'] / med['fused']:.3f}"
          + (f"  fused / stack: {med['fused'] / med['stack']:.3f}" if "stack" in med else "  (no stack)") + " " + what)
    return 0


if __name__ == "__main__":
    sys.exit(main())
