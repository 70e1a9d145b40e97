"""Step time of the engine with and without metrics recording (in process, no HTTP).

"off": the engine's step hook unset; reader threads only drain their channels.
"on":  the step hook observes two histograms per step; readers go through a RequestTrace (the
       observed queue, then finish(): histograms, outcome counter and the request log line).
Closed loop: `--concurrency` reader threads keep the batch full, so wall time / engine steps is
the mean step time. Modes alternate (off, on, off, on, ...) to share the machine's noise.

    HF_HUB_OFFLINE=1 python benchmarks/archive/metrics_overhead.py [--model-dir DIR] [--reps 5]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from handler.config import load_config  # noqa: E402
from handler.http.metrics import Metrics, RequestTrace  # noqa: E402
from handler.engine.request import SamplingParams  # noqa: E402
from handler.server import build_engine  # noqa: E402

PROPS = ("option.rolling_batch=lmi-dist\noption.paged_attention=true\noption.max_rolling_batch_size={width}\n"
         "option.kv_cache_tokens=8192\noption.block_size=16\n")


def run(engine, metrics, on: bool, n: int, concurrency: int, new_tokens: int, prompt_ids):
    """(wall seconds, process CPU seconds) per engine step."""
    engine.on_step = metrics.observe_step if on else None
    todo = iter(range(n))
    lock = threading.Lock()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    def reader():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            trace = RequestTrace(metrics, f"r{i}") if on else None
            chans = engine.submit([prompt_ids], params)
            if on:
                trace.watch(chans)
            while True:
                ev = chans[0].events.get(timeout=120)
                if getattr(ev, "done", None) is not None or not hasattr(ev, "done"):
                    break
            if on:
                trace.finish(200)

    steps0 = engine.scheduler.stats["steps"]
    t0, c0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=reader) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps = engine.scheduler.stats["steps"] - steps0
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="default: build the tiny demo model in a temporary directory")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    model_dir = a.model_dir
    if model_dir is None:
        from handler.tools.demo_model import build_demo_model
        model_dir = os.path.join(tmp, "demo")
        build_demo_model(model_dir)
    props = os.path.join(tmp, "serving.properties")
    with open(props, "w") as f:
        f.write(PROPS.format(width=a.concurrency))
    cfg = load_config(props, model_dir, {})
    engine = build_engine(cfg)
    metrics = Metrics(cfg.model_id, cfg.strategy, lambda: engine)
    # The request line goes where the server's goes (a stream), here to /dev/null.
    logging.getLogger("lmi.request").addHandler(logging.StreamHandler(open(os.devnull, "w")))
    logging.getLogger("lmi.request").setLevel(logging.INFO)
    logging.getLogger("lmi.request").propagate = False
    prompt = engine.tokenize("def fibonacci(n):\n    " * 4)
    run(engine, metrics, True, a.concurrency, a.concurrency, 8, prompt)        # warm-up
    times = {"off": [], "on": []}
    cpu = {"off": [], "on": []}
    for _ in range(a.reps):
        for mode in ("off", "on"):
            wall, used = run(engine, metrics, mode == "on", a.requests, a.concurrency, a.max_new_tokens, prompt)
            times[mode].append(wall)
            cpu[mode].append(used)
    engine.shutdown()

    class _Plan:
        items = [type("I", (), {"token_ids": [1]})()] * a.concurrency
    hook_us = min(timeit.repeat(lambda: metrics.observe_step(_Plan), number=2000, repeat=5)) / 2000 * 1e6
    off, on = min(times["off"]), min(times["on"])
    ratios = [y / x for x, y in zip(times["off"], times["on"])]
    print(f"steps of {a.concurrency} sequences, {a.requests} requests x {a.max_new_tokens} tokens, "
          f"{a.reps} alternating reps")
    print(f"mean step time, metrics off: best {off * 1e3:.2f} ms  "
          f"(reps: {', '.join(f'{x * 1e3:.2f}' for x in times['off'])})")
    print(f"mean step time, metrics on:  best {on * 1e3:.2f} ms  "
          f"(reps: {', '.join(f'{x * 1e3:.2f}' for x in times['on'])})")
    print(f"ratio on/off: {on / off:.3f} (best vs best), paired reps median {statistics.median(ratios):.3f}")
    print(f"process CPU time per step: off {min(cpu['off']) * 1e3:.2f} ms, on {min(cpu['on']) * 1e3:.2f} ms "
          f"(best), ratio {min(cpu['on']) / min(cpu['off']):.3f}; paired median "
          f"{statistics.median(y / x for x, y in zip(cpu['off'], cpu['on'])):.3f}")
    print(f"engine thread's own cost (step hook): {hook_us:.1f} us per step = "
          f"{hook_us * 1e-6 / off * 100:.3f}% of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
