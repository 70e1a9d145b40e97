"""Speculative decoding (prompt lookup, option.speculative_config={"method": "ngram"}, or a draft model with
--draft-model) against plain decoding: one paged server per arm on the same model, the input-grounded edit workload and the plain
chat workload (handler/tools/bench/workloads.py EDIT_CPU_135M, CHAT_CPU_135M), at 1, 4 and 50 clients,
the arms interleaved per repetition (off, on, on, off, ...) to share the machine's noise. Reports per
(model, workload, clients, arm): TPOT p50/p90, req/s, output tok/s, and for the speculative arm the
acceptance read from the server's /metrics (lmi_spec_decode_*: proposed, accepted, verifies -> rate
and mean tokens per verify) over that run; then the on/off ratios. Greedy, EOS honoured, fp32, CPU.

    HF_HUB_OFFLINE=1 python benchmarks/spec_decode.py \
        [--models smollm2,qwen2.5-coder-0.5b] [--workloads edit,chat] [--clients 1,4,50] \
        [--requests-per-client 4] [--min-requests 8] [--reps 2] [--k 5] [--disable-by-batch-size 16] \
        [--out benchmarks/results/spec-decode]

--smoke: one model (smollm2), one repetition, 2 requests per point at 1 and 4 clients, 48 tokens.
--draft-model NAME: the speculative arm proposes with that model (one of the --models names, or a
model dir) instead of prompt lookup; Qwen2.5-Coder-1.5B with the 0.5B as draft:

    HF_HUB_OFFLINE=1 python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b \
        --draft-model qwen2.5-coder-0.5b --out benchmarks/results/spec-decode-draft
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import requests  # noqa: E402

from handler.tools.bench.client import run_load, wait_ready  # noqa: E402
from handler.tools.bench.compare import free_port  # noqa: E402
from handler.tools.bench.metrics import summarise  # noqa: E402
from handler.tools.bench.scrape import parse  # noqa: E402
from handler.tools.bench.workloads import CHAT_CPU_135M, EDIT_CPU_135M  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {"edit": EDIT_CPU_135M, "chat": CHAT_CPU_135M}
MODELS = ("smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def props(w, spec: str | None) -> str:
    lines = ["option.rolling_batch=auto", "option.paged_attention=true",
             f"option.max_rolling_batch_size={w.max_rolling_batch_size}",
             f"option.max_rolling_batch_prefill_tokens={w.prefill_tokens}",
             f"option.kv_cache_tokens={w.kv_cache_tokens}", "option.dtype=fp32", "option.device=cpu"]
    if spec:
        lines.append(f"option.speculative_config={spec}")
    return "\n".join(lines) + "\n"


def spec_counters(url: str) -> dict:
    """{method: {proposed, accepted, verifies}} from /metrics (counters: their _total samples)."""
    m = parse(requests.get(url + "/metrics", timeout=10).text)
    out: dict = {}
    for key in ("proposed", "accepted", "verifies"):
        for labels, v in m.get(f"lmi_spec_decode_{key}_total", {}).items():
            out.setdefault(dict(labels)["method"], {})[key] = v
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for method, c in after.items():
        b = before.get(method, {})
        d = {k: c[k] - b.get(k, 0) for k in c}
        d["acceptance_rate"] = d["accepted"] / d["proposed"] if d.get("proposed") else None
        d["mean_tokens_per_verify"] = (d["accepted"] + d["verifies"]) / d["verifies"] if d.get("verifies") else None
        out[method] = d
    return out


class Arm:
    def __init__(self, name: str, model: str, w, spec: str | None, out: str, tmp: str):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pf = os.path.join(tmp, f"{name}.properties")
        with open(pf, "w") as f:
            f.write(props(w, spec))
        self.log = open(os.path.join(out, f"server-{os.path.basename(model)}-{name}.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "handler", "serve", "--properties", pf, "--model-dir",
                                      model, "--port", str(self.port), "--host", "127.0.0.1"], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def model_dir_of(name: str) -> str:
    from handler.tools.real_model import QWEN_05B, QWEN_15B, build_real_model
    path = os.path.join(ROOT, ".cache", "models", name)
    spec = {"qwen2.5-coder-0.5b": QWEN_05B, "qwen2.5-coder-1.5b": QWEN_15B}.get(name)
    return build_real_model(path) if spec is None else build_real_model(path, model=spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--clients", default="1,4,50")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: each workload's own")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, default=16,
                    help="disable_by_batch_size of the speculative arm (0: never)")
    ap.add_argument("--draft-model", default=None,
                    help="the speculative arm's draft model (a --models name or a model dir); default: prompt lookup")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "spec-decode"))
    a = ap.parse_args()
    if a.smoke:
        a.models, a.clients, a.requests_per_client, a.min_requests, a.reps = "smollm2", "1,4", 1, 2, 1
        a.max_new_tokens = a.max_new_tokens or 48
    clients = [int(c) for c in a.clients.split(",")]
    if a.draft_model:
        draft = model_dir_of(a.draft_model) if a.draft_model in MODELS else a.draft_model
        spec = {"method": "draft_model", "num_speculative_tokens": a.k, "model": draft}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": a.lookup_max}
    if a.disable_by_batch_size:
        spec["disable_by_batch_size"] = a.disable_by_batch_size
    spec_json = json.dumps(spec)
    os.makedirs(a.out, exist_ok=True)
    from transformers import AutoTokenizer
    results = {"host": {"machine": platform.machine(), "processor": platform.processor() or platform.node(),
                        "cpus": len(os.sched_getaffinity(0))}, "spec": spec, "runs": []}
    for name in a.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: {name!r} is not one of {', '.join(MODELS)}")
        model = model_dir_of(name)
        tok = AutoTokenizer.from_pretrained(model)
        for wname in a.workloads.split(","):
            w = WORKLOADS[wname]
            if a.max_new_tokens:
                w = replace(w, max_new_tokens=(a.max_new_tokens,))
            n_max = max(max(a.min_requests, a.requests_per_client * c) for c in clients)
            bodies = replace(w, requests=n_max).draw(tok)
            with tempfile.TemporaryDirectory() as tmp:
                arms = {"off": Arm("off", model, w, None, a.out, tmp), "on": Arm("on", model, w, spec_json, a.out, tmp)}
                try:
                    for arm in arms.values():
                        wait_ready(arm.url, 600, arm.proc)
                        warm = [dict(b, parameters=dict(b["parameters"], max_new_tokens=4)) for b in bodies[:4]]
                        run_load(arm.url + "/invocations", warm, 2, progress=False)
                    for c in clients:
                        mine = bodies[:max(a.min_requests, a.requests_per_client * c)]
                        for rep in range(a.reps):
                            for arm_name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                                arm = arms[arm_name]
                                before = spec_counters(arm.url)
                                recs, dur = run_load(arm.url + "/invocations", mine, c, progress=False)
                                acc = delta(spec_counters(arm.url), before)
                                s = summarise(recs, c, dur)
                                row = {"model": name, "workload": wname, "clients": c, "rep": rep, "arm": arm_name,
                                       "requests": len(mine), **{k: s.get(k) for k in (
                                           "requests_per_s", "output_tokens_per_s", "tpot_p50", "tpot_p90",
                                           "ttft_p50", "errors", "output_tokens")}, "spec": acc}
                                results["runs"].append(row)
                                ng = acc.get(spec["method"], {})
                                print(f"{name} {wname} @{c} rep {rep + 1} {arm_name}: "
                                      f"{s['requests_per_s']:.2f} req/s, TPOT p50 "
                                      f"{(s['tpot_p50'] or 0) * 1e3:.1f} ms, {s['errors']} errors"
                                      + (f", acceptance {ng['acceptance_rate']:.2f}, "
                                         f"{ng['mean_tokens_per_verify']:.2f} tokens/verify"
                                         if ng.get("acceptance_rate") is not None else ""), flush=True)
                finally:
                    for arm in arms.values():
                        arm.stop()
    md = report(results)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def report(results: dict) -> str:
    """One row per (model, workload, clients): both arms pooled over repetitions, and on/off ratios."""
    groups: dict = {}
    for r in results["runs"]:
        groups.setdefault((r["model"], r["workload"], r["clients"]), {}).setdefault(r["arm"], []).append(r)

    def mean(rows, k):
        xs = [x[k] for x in rows if x.get(k) is not None]
        return sum(xs) / len(xs) if xs else None

    h = results["host"]
    method = {"ngram": "Prompt-lookup", "draft_model": "Draft-model"}[results["spec"]["method"]]
    md = (f"# {method} speculative decoding vs plain decoding (paged, fp32, CPU)\n\n"
          f"Host: {h['processor']} ({h['machine']}), {h['cpus']} CPUs. Speculative arm: "
          f"`option.speculative_config={json.dumps(results['spec'])}`.\n\n"
          "| model | workload | clients | TPOT p50 off / on ms | ratio | req/s off / on | ratio | acceptance | "
          "tokens / verify |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for (model, wl, c), arms in sorted(groups.items()):
        off, on = arms.get("off", []), arms.get("on", [])
        t0, t1 = mean(off, "tpot_p50"), mean(on, "tpot_p50")
        r0, r1 = mean(off, "requests_per_s"), mean(on, "requests_per_s")
        ng = [x["spec"].get(results["spec"]["method"], {}) for x in on]
        prop, acc, ver = (sum(x.get(k, 0) for x in ng) for k in ("proposed", "accepted", "verifies"))
        md += (f"| {model} | {wl} | {c} | {fmt(t0 and t0 * 1e3, '.1f')} / {fmt(t1 and t1 * 1e3, '.1f')} | "
               f"{fmt(t1 / t0 if t0 and t1 else None, '.2f')} | {fmt(r0, '.2f')} / {fmt(r1, '.2f')} | "
               f"{fmt(r1 / r0 if r0 and r1 else None, '.2f')} | {fmt(acc / prop if prop else None, '.2f')} | "
               f"{fmt((acc + ver) / ver if ver else None, '.2f')} |\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
