"""Guided decoding's per-step cost, in process (no HTTP): one paged engine, the same 32 chat prompts
submitted at once, 48 tokens each (EOS ignored), either all unconstrained or every other one under
a JSON schema whose string fields are long enough never to end the answer early (so both modes
generate exactly the same number of tokens). Modes alternate (plain, mixed, mixed, plain, ...) to
share the machine's noise; reported: wall and process CPU seconds per generated token, and the
median of the paired mixed/plain ratios.

    HF_HUB_OFFLINE=1 python benchmarks/archive/guided_step_cost.py [--reps 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from handler.config import load_config  # noqa: E402
from handler.engine.request import parse_params  # noqa: E402
from handler.server import build_engine  # noqa: E402
from handler.tools.bench.workloads import ANSWER_SCHEMA, INSTRUCTIONS, TOPICS, chat_prompt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Long strings: the grammar never completes within the token budget, so every row runs to the end.
SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "minLength": 400},
                                           "points": {"type": "array", "items": {"type": "string"}}},
          "required": ["topic", "points"]}


def run(engine, prompts, params) -> tuple[float, float, int]:
    t0, c0 = time.perf_counter(), time.process_time()
    chans = [engine.submit([engine.tokenize(p)], q)[0] for p, q in zip(prompts, params)]
    n = 0
    for ch in chans:
        while True:
            ev = ch.events.get(timeout=900)
            assert hasattr(ev, "id"), ev
            n += 1
            if ev.done:
                break
    return time.perf_counter() - t0, time.process_time() - c0, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=os.path.join(ROOT, ".cache", "models", "smollm2"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--schema", choices=("long", "answer"), default="long",
                    help="long: SCHEMA here; answer: the bench workload's ANSWER_SCHEMA (bounded strings; an "
                         "answer may end before --tokens)")
    ap.add_argument("--out")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "serving.properties")
        with open(path, "w") as f:
            f.write(f"option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=64\n"
                    f"option.kv_cache_tokens=12800\noption.dtype=fp32\noption.device=cpu\n")
        engine = build_engine(load_config(path, a.model_dir, env={}))
    tok = engine.tokenizer
    prompts = [chat_prompt(tok, INSTRUCTIONS[i % len(INSTRUCTIONS)].format(topic=TOPICS[i % len(TOPICS)]))
               for i in range(a.requests)]
    plain = [parse_params({"max_new_tokens": a.tokens, "ignore_eos": True})] * a.requests
    mixed = [parse_params({"max_new_tokens": a.tokens, "ignore_eos": True,
                           **({"guided_json": SCHEMA if a.schema == "long" else ANSWER_SCHEMA} if i % 2 else {})})
             for i in range(a.requests)]
    run(engine, prompts[:4], mixed[:4])      # warm-up: kernels, the grammar's first compile
    res = {"plain": [], "mixed": []}
    for rep in range(a.reps):
        for mode in (("plain", "mixed") if rep % 2 == 0 else ("mixed", "plain")):
            wall, cpu, n = run(engine, prompts, plain if mode == "plain" else mixed)
            res[mode].append({"wall_s": wall, "cpu_s": cpu, "tokens": n})
            print(f"rep {rep + 1} {mode}: {n} tokens, {1e3 * wall / n:.2f} ms wall and {1e3 * cpu / n:.2f} ms CPU "
                  f"per token", flush=True)
    engine.shutdown()
    ratio = {k: statistics.median(m[k] / p[k] for m, p in zip(res["mixed"], res["plain"])) for k in ("wall_s", "cpu_s")}
    out = {"requests": a.requests, "tokens_each": a.tokens, "schema": a.schema, "guided_share": 0.5, "runs": res,
           "median_ratio_mixed_over_plain": ratio}
    print(f"mixed / plain, median of {a.reps} pairs: wall {ratio['wall_s']:.3f}, CPU {ratio['cpu_s']:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
