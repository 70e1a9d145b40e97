"""Cost of mixed LoRA traffic over base-only traffic, in process (no HTTP), same engine.

One paged engine with `option.enable_lora=true` and 4 demo adapters (rank 8 on q/v/o/down).
Each rep submits the same `--requests` prompts at once, either all for the base model or spread
round-robin over the 4 adapters (4 adapters in every step), and measures wall time per engine
step and generated tokens per second. Modes alternate (base, mixed, base, ...) to share the
machine's noise; the figure to read is the median of the paired ratios.

    HF_HUB_OFFLINE=1 python benchmarks/archive/lora_overhead.py [--model-dir DIR] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from handler.config import load_config  # noqa: E402
from handler.tools.demo_model import build_demo_adapters, build_demo_model  # noqa: E402
from handler.engine.request import SamplingParams  # noqa: E402
from handler.server import build_engine  # noqa: E402

PROPS = ("option.rolling_batch=auto\noption.max_rolling_batch_size={width}\noption.enable_lora=true\n"
         "option.max_loras=4\noption.device=cpu\noption.dtype=fp32\n")
PROMPTS = ["def add(a, b):", "class Stack:", "import os\nimport", "for i in range(10):"]


def run(engine, adapters, n: int, new_tokens: int) -> tuple[float, int, int]:
    """(wall seconds, engine steps, generated tokens) for n requests submitted at once."""
    steps0 = engine.scheduler.stats["steps"]
    t0 = time.perf_counter()
    chans = []
    for i in range(n):
        a = adapters[i % len(adapters)] if adapters else None
        chans += engine.submit([engine.tokenize(PROMPTS[i % len(PROMPTS)])],
                               SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, adapter=a))
    tokens = 0
    for ch in chans:
        while True:
            ev = ch.events.get(timeout=600)
            tokens += 1
            if getattr(ev, "done", None) is not None or not hasattr(ev, "id"):
                break
    return time.perf_counter() - t0, engine.scheduler.stats["steps"] - steps0, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", help="a model with adapters/ (default: a demo llama + 4 adapters)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="lora-overhead-")
    try:
        model_dir = a.model_dir
        if model_dir is None:
            model_dir = build_demo_model(os.path.join(tmp, "model"))
            build_demo_adapters(model_dir, 4)
        props = os.path.join(tmp, "serving.properties")
        with open(props, "w") as f:
            f.write(PROPS.format(width=a.requests))
        engine = build_engine(load_config(props, model_dir, env={}))
        lora = engine.runner.lora
        adapters = [lora.get(x["name"]) for x in lora.list()][:4]
        run(engine, None, a.requests, 4)          # warm-up
        run(engine, adapters, a.requests, 4)
        rows = {"base": [], "mixed": []}
        for _ in range(a.reps):
            for mode in ("base", "mixed"):
                wall, steps, tokens = run(engine, adapters if mode == "mixed" else None,
                                          a.requests, a.new_tokens)
                rows[mode].append((wall / steps, tokens / wall))
        engine.shutdown()
        ratios = [m[0] / b[0] for b, m in zip(rows["base"], rows["mixed"])]
        for mode, r in rows.items():
            print(f"{mode:5s} step ms {[round(x[0] * 1e3, 1) for x in r]}, "
                  f"tokens/s {[round(x[1]) for x in r]}")
        print(f"mixed ({len(adapters)} adapters) / base step time: median of paired ratios "
              f"{statistics.median(ratios):.3f} (pairs {[round(x, 3) for x in ratios]})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
