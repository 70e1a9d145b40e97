"""Priority classes under a flood (issue 64): do short interactive requests keep their first-token time
while long batch requests saturate the server?

  python benchmarks/priority_flood.py --model-dir DIR [--reps 2] [--out FILE.json]

Per repetition and arm (a fresh server each; the arms' order alternates):
  unloaded  H clients send short requests (prompts of ~--short-tokens, --short-new tokens), alone;
  flooded   L clients send long requests (~--long-tokens, --long-new tokens) back to back, filling the
            running batch (--max-running, default L), and once the flood runs (--settle s) the same H
            clients send the same short requests.
Arms: `priority` (option.scheduling_policy=priority; the flood at priority 10, the short ones at 0) and
`fcfs` (the default policy, no priorities sent). Reported per arm: the short requests' TTFT p50/p90
unloaded and flooded and their ratio, TPOT p50/p90, and every request answered or not (nothing lost).
Prints one JSON object. Streams, so TTFT is the first streamed token as the client saw it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.flood import Server as FloodServer  # noqa: E402
from handler.tools.bench.client import run_load  # noqa: E402
from handler.tools.bench.metrics import summarise  # noqa: E402
from handler.tools.tune import prompt_with_tokens  # noqa: E402


class Server(FloodServer):
    TAG = "priority"


def bodies(tok, n: int, tokens: int, new: int, tag: str, priority: int | None) -> list[dict]:
    """n unique prompts of about `tokens` tokens (unique from their first token: no shared prefix)."""
    text = prompt_with_tokens(tok, tokens)
    out = []
    for i in range(n):
        params = {"max_new_tokens": new, "ignore_eos": True, "details": True}
        if priority is not None:
            params["priority"] = priority
        out.append({"inputs": f"{tag} {i}: {text}", "parameters": params, "stream": True})
    return out


def phase(url: str, short: list[dict], clients: int, flood: list[dict] | None, flood_clients: int,
          settle: float) -> dict:
    """The short requests through `clients` closed-loop clients, with the flood running or not."""
    got: dict = {}
    stop = threading.Event()
    t = None
    if flood:
        def run_flood():
            got["flood"] = run_load(url, flood, flood_clients, progress=False, stop=stop)
        t = threading.Thread(target=run_flood)
        t.start()
        time.sleep(settle)
    recs, dur = run_load(url, short, clients, progress=False)
    out = {"short": summarise(recs, clients, dur)}
    if t is not None:
        stop.set()
        t.join()
        frecs, fdur = got["flood"]
        out["flood"] = summarise(frecs, flood_clients, fdur)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--short-clients", type=int, default=10)
    ap.add_argument("--short-requests", type=int, default=30)
    ap.add_argument("--short-tokens", type=int, default=20)
    ap.add_argument("--short-new", type=int, default=16)
    ap.add_argument("--long-clients", type=int, default=40)
    ap.add_argument("--long-tokens", type=int, default=400)
    ap.add_argument("--long-new", type=int, default=96)
    ap.add_argument("--max-running", type=int, default=40,
                    help="option.max_rolling_batch_size (default: the flood fills the batch)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of flood before the short requests")
    ap.add_argument("--extra", default="", help="more properties for both arms, ';'-separated")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    kv = a.long_clients * (a.long_tokens + a.long_new + 32) + a.short_clients * (a.short_tokens + a.short_new + 32)
    base = ("option.rolling_batch=auto\noption.paged_attention=true\noption.dtype=fp32\n"
            f"option.max_rolling_batch_size={a.max_running}\noption.max_rolling_batch_prefill_tokens=4096\n"
            f"option.kv_cache_tokens={kv}\n" + "".join(f"{x.strip()}\n" for x in a.extra.split(";") if x.strip()))
    arms = {"priority": (base + "option.scheduling_policy=priority\n", 0, 10), "fcfs": (base, None, None)}
    logs = tempfile.mkdtemp(prefix="priority-flood-")
    results: dict = {name: [] for name in arms}
    for rep in range(a.reps):
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
        for name in order:
            props, hi, lo = arms[name]
            short = bodies(tok, a.short_requests, a.short_tokens, a.short_new, f"short r{rep}", hi)
            flood = bodies(tok, 100 * a.long_clients, a.long_tokens, a.long_new, f"long r{rep}", lo)
            srv = Server(a.model_dir, props, logs)
            try:
                run_load(srv.url + "/invocations", short[:4], 4, progress=False)      # warm-up
                res = {"unloaded": phase(srv.url + "/invocations", short, a.short_clients, None, 0, 0)}
                res["flooded"] = phase(srv.url + "/invocations", short, a.short_clients, flood, a.long_clients,
                                       a.settle)
                res["preemptions"] = srv.metric("lmi_preemptions_total")
            finally:
                srv.stop()
            u, f = res["unloaded"]["short"], res["flooded"]["short"]
            res["ttft_p90_ratio"] = f["ttft_p90"] / u["ttft_p90"] if u["ttft_p90"] else None
            results[name].append(res)
            print(f"rep {rep + 1} {name}: short TTFT p90 {1e3 * u['ttft_p90']:.0f} ms unloaded, "
                  f"{1e3 * f['ttft_p90']:.0f} ms flooded ({res['ttft_p90_ratio']:.2f}x); flood answered "
                  f"{res['flooded']['flood']['completed']}/{res['flooded']['flood']['n']}, errors "
                  f"{f['errors'] + res['flooded']['flood']['errors']}", file=sys.stderr, flush=True)
    out = {"args": vars(a), "properties": {k: v[0] for k, v in arms.items()}, "logs": logs, "results": results}
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
