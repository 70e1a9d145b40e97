"""Cost of guided decoding: the chat workload unconstrained vs. the same requests with half of them
JSON-schema constrained (parameters.guided_json, handler/tools/bench/workloads.py ANSWER_SCHEMA),
one paged server, the two arms interleaved (plain, mixed, mixed, plain, ...) to share the machine's
noise. Reports req/s, output tok/s, TPOT and the server's CPU-seconds per 1k output tokens per arm
(pooled), the per-repetition paired ratios (mixed over the plain run next to it) and their median,
and the constrained requests' own TPOT next to their unconstrained batch mates'. On a shared,
noisy machine read the CPU-seconds per token and the paired medians, not one wall-clock figure.

    HF_HUB_OFFLINE=1 python benchmarks/structured_overhead.py [--requests 80] [--reps 2] \
        [--out benchmarks/results/structured-135m]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from handler.tools.bench.client import run_load, wait_ready  # noqa: E402
from handler.tools.bench.compare import free_port  # noqa: E402
from handler.tools.bench.cputime import TreeCpu  # noqa: E402
from handler.tools.bench.metrics import summarise, tpot  # noqa: E402
from handler.tools.bench.workloads import CHAT_JSON_CPU_135M  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def props(w) -> str:
    return (f"option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size="
            f"{w.max_rolling_batch_size}\noption.max_rolling_batch_prefill_tokens={w.prefill_tokens}\n"
            f"option.kv_cache_tokens={w.kv_cache_tokens}\noption.dtype=fp32\noption.device=cpu\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="default: the real SmolLM2-135M-Instruct in .cache/models/smollm2")
    ap.add_argument("--requests", type=int, default=CHAT_JSON_CPU_135M.requests)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=CHAT_JSON_CPU_135M.max_new_tokens[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "structured-135m"))
    a = ap.parse_args()
    model = a.model_dir
    if model is None:
        from handler.tools.real_model import build_real_model
        model = build_real_model(os.path.join(ROOT, ".cache", "models", "smollm2"))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    mixed_w = replace(CHAT_JSON_CPU_135M, requests=a.requests, max_new_tokens=(a.max_new_tokens,))
    plain_w = replace(mixed_w, constrained=0.0)
    arms = {"plain": plain_w.draw(tok), "mixed": mixed_w.draw(tok)}
    guided = [i for i, b in enumerate(arms["mixed"]) if "guided_json" in b["parameters"]]
    assert [b["inputs"] for b in arms["plain"]] == [b["inputs"] for b in arms["mixed"]]

    os.makedirs(a.out, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        pf = os.path.join(tmp, "serving.properties")
        with open(pf, "w") as f:
            f.write(props(mixed_w))
        log = open(os.path.join(a.out, "server.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "handler", "serve", "--properties", pf, "--model-dir", model,
                                 "--port", str(port), "--host", "127.0.0.1"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            wait_ready(url, 300, proc)
            warm = [dict(b, parameters=dict(b["parameters"], max_new_tokens=4)) for b in arms["mixed"][:8]]
            run_load(url + "/invocations", warm, 4, progress=False)
            runs: dict[str, list] = {"plain": [], "mixed": []}
            cpus: dict[str, list] = {"plain": [], "mixed": []}
            for rep in range(a.reps):
                for arm in (("plain", "mixed") if rep % 2 == 0 else ("mixed", "plain")):
                    with TreeCpu(proc.pid) as cpu:
                        recs, dur = run_load(url + "/invocations", arms[arm], mixed_w.concurrency, progress=False)
                    runs[arm].append((recs, dur))
                    cpus[arm].append(cpu.seconds)
                    s = summarise(recs, mixed_w.concurrency, dur)
                    print(f"rep {rep + 1} {arm}: {s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.0f} "
                          f"tok/s, TPOT p50 {s['tpot_p50'] * 1e3:.1f} ms, {1e3 * cpu.seconds / s['output_tokens']:.2f} "
                          f"CPU-s/1k tok, {s['errors']} errors", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
            log.close()

    def pooled(arm, only=None):
        recs = [r for rr, _ in runs[arm] for i, r in enumerate(rr) if only is None or (i in only)]
        return summarise(recs, mixed_w.concurrency, sum(d for _, d in runs[arm]))

    def tpot_mean(arm, idx):
        xs = [tpot(r.latency, r.ttft, r.tokens) for rr, _ in runs[arm] for i, r in enumerate(rr)
              if i in idx and r.error is None]
        xs = [x for x in xs if x is not None]
        return statistics.mean(xs) if xs else None

    plain, mixed = pooled("plain"), pooled("mixed")
    for arm, x in (("plain", plain), ("mixed", mixed)):
        x["cpu_s_per_1k_tokens"] = 1e3 * sum(cpus[arm]) / x["output_tokens"]
    per = {arm: [summarise(rr, mixed_w.concurrency, d) for rr, d in runs[arm]] for arm in runs}
    paired = {k: statistics.median(m[k] / p[k] for m, p in zip(per["mixed"], per["plain"]))
              for k in ("requests_per_s", "output_tokens_per_s", "tpot_p50")}
    paired["cpu_s_per_token"] = statistics.median(
        (cm / m["output_tokens"]) / (cp / p["output_tokens"])
        for cm, cp, m, p in zip(cpus["mixed"], cpus["plain"], per["mixed"], per["plain"]))
    rest = set(range(a.requests)) - set(guided)
    result = {
        "workload": mixed_w.to_dict(), "reps": a.reps, "model": model, "strategy": "paged",
        "plain": {k: plain[k] for k in ("requests_per_s", "output_tokens_per_s", "tpot_p50", "tpot_p99",
                                        "ttft_p50", "errors", "output_tokens", "cpu_s_per_1k_tokens")},
        "mixed": {k: mixed[k] for k in ("requests_per_s", "output_tokens_per_s", "tpot_p50", "tpot_p99",
                                        "ttft_p50", "errors", "output_tokens", "cpu_s_per_1k_tokens")},
        "paired_median_ratios": paired,
        "ratio_requests_per_s": mixed["requests_per_s"] / plain["requests_per_s"],
        "ratio_output_tokens_per_s": mixed["output_tokens_per_s"] / plain["output_tokens_per_s"],
        "ratio_tpot_p50": mixed["tpot_p50"] / plain["tpot_p50"],
        # Within the mixed arm: the constrained requests' TPOT over their unconstrained batch mates'.
        "tpot_mean_constrained_s": tpot_mean("mixed", set(guided)),
        "tpot_mean_unconstrained_mates_s": tpot_mean("mixed", rest),
        "per_rep": {arm: [{"requests_per_s": x["requests_per_s"], "output_tokens_per_s": x["output_tokens_per_s"],
                           "tpot_p50": x["tpot_p50"], "cpu_s": c} for x, c in zip(per[arm], cpus[arm])]
                    for arm in runs},
    }
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    r = result
    md = (f"# Guided decoding's cost (paged, SmolLM2-135M-Instruct fp32, CPU)\n\n"
          f"{mixed_w.note}. Here: {a.requests} requests, at most {a.max_new_tokens} new tokens each; {a.requests} requests, {mixed_w.concurrency} clients, {a.reps} interleaved "
          f"repetitions per arm, pooled.\n\n"
          f"| arm | req/s | out tok/s | TPOT p50 / p99 ms | TTFT p50 ms | output tokens | CPU-s / 1k out tok | errors |\n"
          f"|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for arm in ("plain", "mixed"):
        x = r[arm]
        md += (f"| {arm} | {x['requests_per_s']:.2f} | {x['output_tokens_per_s']:.0f} | {x['tpot_p50'] * 1e3:.1f} / "
               f"{x['tpot_p99'] * 1e3:.1f} | {x['ttft_p50'] * 1e3:.0f} | {x['output_tokens']} | "
               f"{x['cpu_s_per_1k_tokens']:.2f} | {x['errors']} |\n")
    pm = r["paired_median_ratios"]
    md += (f"\nMedian of the {a.reps} paired ratios (mixed / the plain run beside it): req/s "
           f"{pm['requests_per_s']:.3f}, output tok/s {pm['output_tokens_per_s']:.3f}, TPOT p50 {pm['tpot_p50']:.3f}, "
           f"server CPU-s per output token {pm['cpu_s_per_token']:.3f}.\n")
    md += (f"\nPooled mixed / plain: req/s {r['ratio_requests_per_s']:.3f}, output tok/s "
           f"{r['ratio_output_tokens_per_s']:.3f}, TPOT p50 {r['ratio_tpot_p50']:.3f}. In the mixed arm the "
           f"constrained requests' mean TPOT is {r['tpot_mean_constrained_s'] * 1e3:.1f} ms, their unconstrained "
           f"batch mates' {r['tpot_mean_unconstrained_mates_s'] * 1e3:.1f} ms.\n\n"
           f"`HF_HUB_OFFLINE=1 python benchmarks/structured_overhead.py --requests {a.requests} --reps {a.reps} "
           f"--max-new-tokens {a.max_new_tokens}`\n")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
