"""Speculative decoding configured against not configured, at the engine: one process, one loaded
model, one Engine per arm over the same runner (the same weights in the same memory), the served
workload's bodies (benchmarks/spec_decode.py's, parsed and tokenized as /invocations does) driven
in a closed loop in this thread, the arms alternating per round (off, on@16, on@4, then reversed).
No HTTP, no second server process: what differs between arms is the configuration alone.

    HF_HUB_OFFLINE=1 python benchmarks/spec_decode_engine.py [--model qwen2.5-coder-0.5b] \
        [--workload chat] [--clients 50] [--requests 50] [--rounds 3] [--disable-by-batch-size 16,4] \
        [--k 5] [--lookup-max 4] [--max-new-tokens N] [--out FILE.json]

Per run: wall, TPOT p50 (a request's (last token - first token) / (tokens - 1)), req/s, the model's
time (Runner.step) and the engine's own (the rest), steps, tokens proposed, and a digest of every
step's plan (per item: sequence (numbered from the run's first), tokens fed, start position, draft
length). Equal digests mean the arms ran the same steps; per round, each arm's ratios to the plain
arm of that round.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import fields, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import spec_decode  # noqa: E402
from handler.engine.loop import DoneEvent, ErrorEvent, TokenEvent  # noqa: E402
from benchmarks.script_common import write_json  # noqa: E402

# ServingConfig fields that name where the configuration came from, not what it is.
PROVENANCE = ("properties", "properties_file", "warnings", "speculative")


def configs(model_dir: str, w, specs: dict[str, dict | None], tmp: str) -> dict:
    """{arm: ServingConfig} from the properties benchmarks/spec_decode.py serves each arm with."""
    from handler.config import load_config
    out = {}
    for name, spec in specs.items():
        path = os.path.join(tmp, f"{name}.properties")
        with open(path, "w") as f:
            f.write(spec_decode.props(w, json.dumps(spec) if spec else None))
        out[name] = load_config(path, model_dir, env={})
    return out


def config_diff(a, b) -> dict:
    """{field: (a's, b's)} for the ServingConfig fields that differ, provenance aside."""
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in fields(a)
            if f.name not in PROVENANCE and getattr(a, f.name) != getattr(b, f.name)}


def requests_of(bodies: list[dict], tokenizer) -> list[tuple[list[int], object]]:
    """(prompt ids, SamplingParams) of each body, as the sagemaker route parses and tokenizes it."""
    from handler.engine.request import SamplingParams
    from handler.http.protocols import lmi, tokenize
    out = []
    for b in bodies:
        gen = lmi.parse(b, default_stream=True, defaults=SamplingParams())
        out.append((tokenize(tokenizer, gen)[0], gen.params))
    return out


class PlanLog:
    """Engine.on_step: a digest of every step's plan, sequences numbered from the run's first."""

    def __init__(self):
        self.base = None
        self.h = hashlib.sha256()
        self.steps = 0

    def __call__(self, plan) -> None:
        if self.base is None:
            self.base = min(it.seq_id for it in plan.items)
        self.h.update(repr([(it.seq_id - self.base, len(it.token_ids), it.start_pos, len(it.draft))
                            for it in plan.items]).encode())
        self.steps += 1


def closed_loop(engine, reqs, clients: int) -> dict:
    """`reqs` through `clients` closed-loop clients, this thread running the iterations."""
    runner = engine.runner
    step, spent = runner.step, [0.0]

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return step(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    log = PlanLog()
    engine.on_step, runner.step = log, timed
    before = {m: dict(v) for m, v in engine.scheduler.spec_stats.items()}
    live, times, nxt = {}, {}, 0
    try:
        t0 = time.perf_counter()
        while nxt < min(clients, len(reqs)):
            live[nxt] = engine.submit([reqs[nxt][0]], reqs[nxt][1])[0]
            times[nxt], nxt = [], nxt + 1
        while live:
            engine.step()
            for i, ch in list(live.items()):
                while not ch.events.empty():
                    ev = ch.events.get()
                    if isinstance(ev, ErrorEvent):
                        raise RuntimeError(f"request {i} failed: {ev}")
                    if isinstance(ev, TokenEvent):
                        times[i].append(ev.time)
                    if isinstance(ev, DoneEvent) or ev.done is not None:
                        del live[i]
                        break
                if i not in live and nxt < len(reqs):
                    live[nxt] = engine.submit([reqs[nxt][0]], reqs[nxt][1])[0]
                    times[nxt], nxt = [], nxt + 1
        wall = time.perf_counter() - t0
    finally:
        engine.on_step, runner.step = None, step
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    after = engine.scheduler.spec_stats
    proposed = sum(after[m]["proposed"] - before.get(m, {}).get("proposed", 0) for m in after)
    return {"requests": len(times), "output_tokens": sum(len(t) for t in times.values()), "wall_s": wall,
            "req_per_s": len(times) / wall, "tpot_p50": statistics.median(tpots) if tpots else None,
            "model_s": spent[0], "engine_s": wall - spent[0], "steps": log.steps, "proposed": proposed,
            "plan_digest": log.h.hexdigest()[:16]}


def order(names: list[str], rnd: int) -> list[str]:
    return spec_decode.arm_order(names, rnd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a benchmarks/spec_decode.py model name or a dir")
    ap.add_argument("--workload", default="chat", choices=sorted(spec_decode.WORKLOADS))
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disable-by-batch-size", default="16,4")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from handler.model.cpu import preload_env
    env = preload_env(os.environ)      # tcmalloc, as `handler serve` runs with it
    if env is not None and argv is None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    from transformers import AutoTokenizer

    from handler.server import build_runner, engine_for
    model = spec_decode.model_dir_of(a.model) if a.model in spec_decode.MODELS else a.model
    w = spec_decode.WORKLOADS[a.workload]
    if a.max_new_tokens:
        w = replace(w, max_new_tokens=(a.max_new_tokens,))
    base = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": a.lookup_max}
    specs = {"off": None, **spec_decode.our_specs(base, spec_decode.disable_values(a.disable_by_batch_size))}
    with tempfile.TemporaryDirectory() as tmp:
        cfgs = configs(model, w, specs, tmp)
    diffs = {n: config_diff(cfgs["off"], c) for n, c in cfgs.items() if n != "off"}
    for n, d in diffs.items():
        print(f"config {n} vs off: {d or 'the same but for option.speculative_config'}", flush=True)
    tok = AutoTokenizer.from_pretrained(model)
    reqs = requests_of(replace(w, requests=a.requests).draw(tok), tok)
    runner = build_runner(cfgs["off"])
    engines = {n: engine_for(c, runner).run_by_hand() for n, c in cfgs.items()}
    kv = {n: e.blocks.num_blocks for n, e in engines.items()}
    print(f"KV blocks per arm: {kv}", flush=True)
    for n, e in engines.items():      # warm-up: 4 requests of 4 tokens, 2 clients
        closed_loop(e, [(ids, replace(p, max_new_tokens=4)) for ids, p in reqs[:4]], 2)
    runs = []
    for rnd in range(a.rounds):
        row = {}
        for n in order(list(engines), rnd):
            r = closed_loop(engines[n], reqs, a.clients)
            row[n] = r
            runs.append({"round": rnd, "arm": n, **r})
            print(f"round {rnd + 1} {n}: {r['req_per_s']:.3f} req/s, TPOT p50 {r['tpot_p50'] * 1e3:.1f} ms, "
                  f"model {r['model_s']:.2f} s + engine {r['engine_s']:.2f} s, {r['steps']} steps, "
                  f"{r['proposed']} proposed, plan {r['plan_digest']}", flush=True)
        off = row["off"]
        for n, r in row.items():
            if n != "off":
                print(f"round {rnd + 1} {n}/off: TPOT {r['tpot_p50'] / off['tpot_p50']:.3f}, req/s "
                      f"{r['req_per_s'] / off['req_per_s']:.3f}, engine-s {r['engine_s'] / off['engine_s']:.3f}, "
                      f"same plan: {r['plan_digest'] == off['plan_digest']}", flush=True)
    out = {"model": model, "workload": a.workload, "clients": a.clients, "requests": a.requests,
           "arms": specs, "config_diff": {n: {k: [repr(x) for x in v] for k, v in d.items()} for n, d in diffs.items()},
           "kv_blocks": kv, "runs": runs,
           "host": {"machine": platform.machine(), "cpus": len(os.sched_getaffinity(0)),
                    "ld_preload": os.environ.get("LD_PRELOAD", "")}}
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
