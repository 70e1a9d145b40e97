"""The paged engine's own throughput: the benchmark's closed loop driven in this thread, no HTTP.

    python -m handler bench engine-loop --model-dir DIR [--dtype fp32|bf16] [--requests 200]
        [--concurrency 50] [--prompt-tokens 15,60,160] [--max-new-tokens 16,32,64] [--reps 2]
        [--preset cpu|cpu-135m] [--quantize int8] [--arm NAME=VALUE ...] [--property option.KEY=VALUE ...]
        [--shared-prefix N] [--out engine_loop.json]

The same shape as `handler bench compare`'s `lmi` workload (50 closed-loop clients, greedy,
ignore_eos, KV 12,800 tokens, 64 running, prefill budget 4,096, block 16), but the clients are
this thread: it submits to the engine, runs its iterations itself (`Engine.step()`) and reads every
channel between two iterations, so nothing else competes for the interpreter or the cores. Against a
served figure (`bench compare`'s paged row) the difference is what serving costs: HTTP
threads, their wake-ups per streamed token, JSON, and the load client sharing the machine.

Prompts are random token ids (no tokenizer round trip), drawn per repetition from one seed;
with --preset, the preset's own request list as `bench compare` serves it (the same prompt
token counts and output lengths: compare these runs with a served figure).
CPU-s / 1k out tok: this process's user + system time over the measured loop; TTFT and TPOT
p50 / p90 from the engine's own token times (`--property` sets a scheduling policy: the latency it buys
without HTTP's noise). `--arm` sets the
runner's CPU A/B arms (handler/model/cpu.py Arms), as benchmarks/step_floor.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

from handler.config import ConfigError
from handler.engine.loop import ErrorEvent
from handler.engine.request import SamplingParams
from handler.tools.bench.inprocess import make_engine
from handler.tools.bench.metrics import percentile


def draw(n: int, prompt_tokens: list[int], max_new: list[int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab - 10) for _ in range(rng.choice(prompt_tokens))],
             rng.choice(max_new)) for _ in range(n)]


def from_preset(name: str, tokenizer) -> list[tuple[list[int], int]]:
    """The `lmi` workload of a `bench compare` preset, exactly as served: the same bodies,
    tokenized as /invocations does, with their max_new_tokens."""
    from handler.tools.bench.workloads import PRESETS
    w = next(w for w in PRESETS[name].workloads if w.name == "lmi")
    return [(tokenizer(b["inputs"])["input_ids"], b["parameters"]["max_new_tokens"])
            for b in w.draw(tokenizer)]


def closed_loop(engine, requests, concurrency: int) -> dict:
    """Run `requests` with `concurrency` in flight; one token event = one output token."""
    def submit(i):
        ids, m = requests[i]
        return engine.submit([ids], SamplingParams(max_new_tokens=m, ignore_eos=True))[0]

    live, nxt = {}, 0
    # Per request: submitted, first token, last token (time.monotonic, the engine's event clock), tokens.
    times: dict[int, list] = {}

    def start(i):
        live[i] = submit(i)
        times[i] = [time.monotonic(), None, None, 0]

    while nxt < min(concurrency, len(requests)):
        start(nxt)
        nxt += 1
    t0, c0 = time.perf_counter(), os.times()
    done = tokens = steps = 0
    while live:
        engine.step()
        steps += 1
        for i, ch in list(live.items()):
            while not ch.events.empty():
                ev = ch.events.get()
                if isinstance(ev, ErrorEvent):
                    raise RuntimeError(f"request {i} failed: {ev}")
                tokens += 1
                t = times[i]
                t[1] = t[1] or ev.time
                t[2], t[3] = ev.time, t[3] + 1
                if ev.done is not None:
                    del live[i]
                    done += 1
                    if nxt < len(requests):
                        start(nxt)
                        nxt += 1
    wall, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    ttft = [f - s for s, f, _, _ in times.values()]
    tpot = [(e - f) / (n - 1) for _, f, e, n in times.values() if n > 1]
    return {"requests": done, "output_tokens": tokens, "iterations": steps, "wall_s": wall,
            "req_per_s": done / wall, "out_tok_per_s": tokens / wall,
            "cpu_s_per_1k_out_tok": 1000.0 * cpu / max(1, tokens),
            **{f"{name}_p{q}_ms": 1000.0 * (percentile(v, q) or 0.0) for name, v in (("ttft", ttft), ("tpot", tpot))
               for q in (50, 90)}}


def main(argv: list[str], reexec: bool = False) -> int:
    """reexec: run again under tcmalloc first, as `handler serve` does (the command line's call)."""
    p = argparse.ArgumentParser(prog="python -m handler bench engine-loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--prompt-tokens", default="15,60,160")
    p.add_argument("--max-new-tokens", default="16,32,64")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=12800)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--preset", choices=("cpu", "cpu-135m", "cpu-qwen-0.5b", "cpu-qwen-1.5b"),
                   help="run this `bench compare` preset's lmi request list, tokenized as served "
                        "(every repetition the same list), instead of random prompts")
    p.add_argument("--quantize", help="option.quantize for the engine (e.g. int8)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=VALUE",
                   help="a CPU A/B arm of the runner, repeatable (handler/model/cpu.py Arms: prepack=0, "
                        "gemm=onednn, bf16_gemm=panels|bf16|fp32, kv_layout=token, decode_stack=0, moe_kernel=0)")
    p.add_argument("--property", action="append", default=[], metavar="KEY=VALUE",
                   help="a serving.properties key for the engine, repeatable (a scheduling policy: "
                        "option.target_tpot_ms=125, option.max_rolling_batch_prefill_tokens=512, ...)")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N tokens (a system prompt; with "
                        "--property option.enable_prefix_caching=true each prompt's rest is a chunk after cached rows)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    props = {}
    for kv in a.property:
        key, eq, value = kv.partition("=")
        if not eq or not key.startswith("option."):
            p.error(f"--property {kv!r}: expected option.KEY=VALUE")
        props[key] = value
    from handler.model.cpu import Arms, preload_env
    try:
        arms = Arms.parse(a.arm)
    except ValueError as e:
        p.error(str(e))
    env = preload_env(os.environ)      # tcmalloc, as `handler serve` runs with it
    if env is not None and reexec:
        os.execve(sys.executable, [sys.executable, "-m", "handler", "bench", "engine-loop", *argv], env)
    try:
        engine = make_engine(a.model_dir, a.dtype, a.max_running, a.kv_tokens, prefill_tokens=4096,
                             quantize=a.quantize, arms=arms, properties=props)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab = engine.tokenizer.vocab_size
    ptoks = [int(x) for x in a.prompt_tokens.split(",")]
    mnew = [int(x) for x in a.max_new_tokens.split(",")]
    served = from_preset(a.preset, engine.tokenizer) if a.preset else None
    prefix = draw(1, [a.shared_prefix], [0], vocab, seed=-2)[0][0] if a.shared_prefix else []

    def prefixed(reqs):
        return [(prefix + ids, m) for ids, m in reqs]
    closed_loop(engine, prefixed(draw(a.concurrency, ptoks, mnew, vocab, seed=-1)), a.concurrency)   # warm-up
    runs = []
    for r in range(a.reps):
        reqs = prefixed(served if served is not None else draw(a.requests, ptoks, mnew, vocab, seed=r))
        res = closed_loop(engine, reqs, a.concurrency)
        runs.append(res)
        print(f"rep {r}: {res['req_per_s']:.2f} req/s, {res['out_tok_per_s']:.0f} out tok/s, "
              f"{res['cpu_s_per_1k_out_tok']:.2f} CPU-s / 1k out tok, TPOT p50/p90 {res['tpot_p50_ms']:.0f}/"
              f"{res['tpot_p90_ms']:.0f} ms, TTFT p50/p90 {res['ttft_p50_ms']:.0f}/{res['ttft_p90_ms']:.0f} ms",
              flush=True)
    prompts = ptoks if served is None else \
        {"preset": a.preset, "mean": sum(len(ids) for ids, _ in served) / len(served)}
    out = {"model_dir": a.model_dir, "dtype": a.dtype, "quantize": a.quantize,
           "requests": a.requests if served is None else len(served),
           "concurrency": a.concurrency, "prompt_tokens": prompts, "max_new_tokens": mnew,
           "shared_prefix": a.shared_prefix,
           "kv_tokens": a.kv_tokens, "max_running": a.max_running, "arms": a.arm, "properties": props,
           "runs": runs,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "ld_preload": os.environ.get("LD_PRELOAD", ""),
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0
