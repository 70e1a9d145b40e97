"""A CPU prompt step two ways, in one process, alternating: the whole decoder stack in one C call
(handler/model/cpu_stack.py, kernels/cpu_layer.c) against the Python layers.

    python benchmarks/archive/prompt_step_ab.py --model-dir DIR [--dtype fp32|bf16] [--quantize int8]
        [--lens 15,60,160,60,15,160,60,160,15,60,160,60,15,60,160] [--rounds 5]

One step of whole prompts of `lens` tokens (the default: the `cpu-135m` preset's prompt lengths,
1,220 rows), the same packed step through both arms `rounds` times each, alternating; the best and
the median per arm, and whether the two arms' logits are equal (they must be, bit for bit).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.step_floor import make_engine  # noqa: E402
from handler.engine.request import SamplingParams  # noqa: E402
from handler.engine.types import StepItem  # noqa: E402
from handler.model.runner import pack_step  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--quantize")
    p.add_argument("--lens", default="15,60,160,60,15,160,60,160,15,60,160,60,15,60,160")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    lens = [int(x) for x in a.lens.split(",")]
    engine = make_engine(a.model_dir, a.dtype, len(lens), 16 * (sum(lens) // 16 + 2 * len(lens) + 16),
                         max(4096, sum(lens)), quantize=a.quantize)
    runner = engine.runner
    model, stack = runner.model, runner.model.decode_stack
    if stack is None:
        print("error: the C stack does not apply to this model here (see the start-up log)", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=4)
    items, blk = [], 0
    for i, n in enumerate(lens):
        ids = torch.randint(10, 30000, (n,), generator=g).tolist()
        nb = -(-n // 16) + 1
        items.append(StepItem(i, ids, 0, list(range(blk, blk + nb)), True, params, ids))
        blk += nb
    packed = pack_step(items, 16)[0]
    times, out = {"stack": [], "python": []}, {}
    try:
        for _ in range(a.rounds + 1):
            for arm in times:
                model.decode_stack = stack if arm == "stack" else None
                t = time.perf_counter()
                out[arm] = runner.forward(packed)
                times[arm].append((time.perf_counter() - t) * 1e3)
    finally:
        model.decode_stack = stack
    for arm, v in times.items():
        v = v[1:]   # the first round warms up
        print(f"{arm:7s} best {min(v):7.1f} ms  median {statistics.median(v):7.1f} ms  ({sum(lens)} rows)")
    ratio = statistics.median(times["python"][1:]) / statistics.median(times["stack"][1:])
    same = torch.equal(out["stack"], out["python"])
    print(f"python / stack: {ratio:.3f}; logits equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
