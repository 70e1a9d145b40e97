"""Speculative decoding (prompt lookup, option.speculative_config={"method": "ngram"}, or a draft model
with --draft-model) against plain decoding: one paged server per arm on the same model, the
input-grounded edit workload and the plain chat workload (handler/tools/bench/workloads.py EDIT_CPU_135M, CHAT_CPU_135M), at 1, 4 and 50 clients,
the arms interleaved per repetition (off, on, on, off, ...) to share the machine's noise. Reports per
(model, workload, clients, system, arm): TPOT p50/p90, req/s, output tok/s, and for the speculative arm the
acceptance read from the server over that run; then the on/off ratios. Greedy, EOS honoured, fp32, CPU.

    HF_HUB_OFFLINE=1 python benchmarks/spec_decode.py \
        [--models smollm2,qwen2.5-coder-0.5b] [--workloads edit,chat] [--clients 1,4,50] \
        [--requests-per-client 4] [--min-requests 8] [--reps 2] [--k 5] [--disable-by-batch-size 16] \
        [--systems ours,openvino,llamacpp] [--out benchmarks/results/spec-decode]

--smoke: one model (smollm2), one repetition, 2 requests per point at 1 and 4 clients, 48 tokens.
--draft-model NAME: the speculative arm proposes with that model (one of the --models names, or a
model dir) instead of prompt lookup; Qwen2.5-Coder-1.5B with the 0.5B as draft:

    HF_HUB_OFFLINE=1 python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b \
        --draft-model qwen2.5-coder-0.5b --out benchmarks/results/spec-decode-draft

--disable-by-batch-size 4,8,16: one speculative arm of ours per value (on@4, on@8, on@16; 0: never off),
all interleaved with the one plain arm.

Every repetition starts fresh servers, in that repetition's arm order (--keep-servers: once for all):
a server process's own speed differs from another's of the same configuration by up to 6-9% here
(benchmarks/results/spec-decode/README.md; where its memory landed is the likely cause), and a server
kept across repetitions would carry that offset into its arm every time. --control adds a second plain server (off-b, A/A) whose ratio
to off is that noise, measured in the same run.

--systems: whose speculation runs, each paired with the same system's plain server, one system at a
time (its arms up together, interleaved like ours; the systems one after another, so that at most two
servers hold memory):
  ours      our paged server, option.speculative_config (acceptance: /metrics lmi_spec_decode_*)
  openvino  OpenVINO GenAI's ContinuousBatchingPipeline behind our thin front (openvino_peer.py) with
            {"prompt_lookup": True} (num_assistant_tokens = --k, max_ngram_size = --lookup-max; its
            lookup tries max_ngram_size..1) or {"draft_model": draft_model(IR)}; acceptance is not
            exposed by its step API: the front counts the tokens each step gave a request after its
            first (tokens / step; no proposal count, so no acceptance rate)
  llamacpp  llama-server with --spec-type ngram-simple (--llamacpp-ngram, the last --llamacpp-ngram-n
            tokens looked up, --k proposed) or draft-simple --spec-draft-model GGUF (--spec-draft-n-max
            --k); acceptance from its /metrics (--metrics: llamacpp:spec_decode_num_*_total)
Peers are installed with `python -m handler bench install-peer openvino|llamacpp`; an absent peer, or a
model it cannot take, is reported under "Not driven" with the reason, and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import requests  # noqa: E402

from handler.tools.bench import llamacpp_peer, openvino_peer  # noqa: E402
from handler.tools.bench.client import LlamaCppCompletions, run_load  # noqa: E402
from handler.tools.bench.compare import THREADS, Server, free_port  # noqa: E402
from handler.tools.bench.metrics import summarise  # noqa: E402
from handler.tools.bench.scrape import parse  # noqa: E402
from handler.tools.bench.workloads import CHAT_CPU_135M, EDIT_CPU_135M  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {"edit": EDIT_CPU_135M, "chat": CHAT_CPU_135M}
MODELS = ("smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
SYSTEMS = ("ours", "openvino", "llamacpp")
SYSTEM_NAMES = {"ours": "ours", "openvino": "OpenVINO GenAI", "llamacpp": "llama.cpp"}


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


def disable_values(raw: str) -> list[int]:
    """--disable-by-batch-size: one value or a comma list of them (0: never off)."""
    try:
        vals = [int(x) for x in raw.split(",")]
    except ValueError:
        raise SystemExit(f"--disable-by-batch-size={raw!r}: integers >= 0, comma-separated (e.g. 4,8,16)") from None
    if not vals or any(v < 0 for v in vals) or len(set(vals)) != len(vals):
        raise SystemExit(f"--disable-by-batch-size={raw!r}: distinct integers >= 0, comma-separated (e.g. 4,8,16)")
    return vals


def our_specs(base: dict, disables: list[int]) -> dict[str, dict]:
    """{arm name: speculative_config} for our speculative arms: "on" when one disable value is swept,
    else "on@<value>" ("on@never" for 0)."""
    out = {}
    for d in disables:
        spec = dict(base)
        if d:
            spec["disable_by_batch_size"] = d
        name = "on" if len(disables) == 1 else f"on@{d or 'never'}"
        out[name] = spec
    return out


@dataclass
class Arm:
    name: str            # "off", "on", "on@8"
    system: str          # ours | openvino | llamacpp
    method: str          # the speculative method its counters are filed under
    server: Server

    @property
    def url(self) -> str:
        return self.server.url

    def counters(self) -> dict:
        """{method: {proposed?, accepted, verifies}} counted by the server since its start."""
        if self.system == "ours":
            return spec_counters(self.url)
        if self.system == "llamacpp":
            return {self.method: llamacpp_peer.spec_counters(requests.get(self.url + "/metrics", timeout=10).text)}
        s = requests.get(self.url + "/spec_stats", timeout=10).json()
        return {self.method: {"verifies": s["decode_steps"], "accepted": s["decode_tokens"] - s["decode_steps"]}}


class NotDriven(Exception):
    """A system that cannot run this cell: the message says why (and what would make it run)."""


CONTROL = "off-b"      # --control: a second plain server, the A/A arm


def our_arms(model: str, w, specs: dict[str, dict], out: str, tmp: str, control: bool = False) -> list[Arm]:
    arms = []
    method = next(iter(specs.values()))["method"]
    for name, spec in {"off": None, **({CONTROL: None} if control else {}), **specs}.items():
        pf = os.path.join(tmp, f"{name}.properties")
        with open(pf, "w") as f:
            f.write(props(w, json.dumps(spec) if spec else None))
        port = free_port()
        cmd = [sys.executable, "-m", "handler", "serve", "--properties", pf, "--model-dir", model,
               "--port", str(port), "--host", "127.0.0.1"]
        log = os.path.join(out, f"server-{os.path.basename(model)}-{name}.log")
        arms.append(Arm(name, "ours", method, Server(name, cmd, log, port, env={"PYTHONPATH": ROOT},
                                                     startup_timeout=600)))
    return arms


def peer_dir_or_skip(mod) -> str:
    ok, where = mod.installed()
    if not ok:
        raise NotDriven(where)
    return where


def openvino_arms(model: str, w, method: str, k: int, lookup_max: int, draft: str | None, out: str,
                  log=print) -> list[Arm]:
    """The plain front and the speculative one over the same fp32 IR (exported once, before any clock)."""
    where = peer_dir_or_skip(openvino_peer)
    try:
        ir = openvino_peer.export(where, model, "fp32", log=log)
        draft_ir = openvino_peer.export(where, draft, "fp32", log=log) if method == "draft_model" else None
    except Exception as e:  # noqa: BLE001 - the export's own error, reported
        raise NotDriven(f"exporting the model to OpenVINO IR failed: {e}") from None
    spec = openvino_peer.spec_args(method, k, max_ngram_size=lookup_max, draft_ir=draft_ir)
    arms = []
    for name, s in (("off", None), ("on", spec)):
        port = free_port()
        cmd, env, held = openvino_peer.server(where, ir, model, port, w.kv_cache_tokens, w.max_rolling_batch_size,
                                              w.prefill_tokens, "fp32", THREADS, spec=s)
        log_path = os.path.join(out, f"server-{os.path.basename(model)}-openvino-{name}.log")
        arms.append(Arm(name, "openvino", method, Server(f"openvino-{name}", cmd, log_path, port, env=env,
                                                         startup_timeout=openvino_peer.STARTUP_TIMEOUT, held=held)))
    return arms


def llamacpp_arms(model: str, w, method: str, k: int, ngram_n: int, ngram_type: str, draft: str | None,
                  out: str, tok, log=print) -> list[Arm]:
    """llama-server plain and speculative over the same f32 GGUF (converted once, before any clock),
    both with --metrics, the KV unified as in `bench compare`."""
    where = peer_dir_or_skip(llamacpp_peer)
    try:
        gguf = llamacpp_peer.convert(where, model, "f32", log=log)
        draft_gguf = llamacpp_peer.convert(where, draft, "f32", log=log) if method == "draft_model" else None
    except Exception as e:  # noqa: BLE001 - the converter's own error, reported
        raise NotDriven(f"converting the model to GGUF failed: {e}") from None
    spec = llamacpp_peer.spec_args(method, k, ngram_n=ngram_n, ngram_type=ngram_type, draft_gguf=draft_gguf,
                                   kv_type="f32", threads=THREADS)
    arms = []
    for name, s in (("off", None), ("on", spec)):
        port = free_port()
        cmd, env, held = llamacpp_peer.server(where, gguf, port, w.kv_cache_tokens, w.max_rolling_batch_size,
                                              w.prefill_tokens, "fp32", THREADS, spec=s, metrics=True)
        log_path = os.path.join(out, f"server-{os.path.basename(model)}-llamacpp-{name}.log")
        arms.append(Arm(name, "llamacpp", method, Server(f"llamacpp-{name}", cmd, log_path, port,
                                                         api=LlamaCppCompletions(tok), env=env,
                                                         health=llamacpp_peer.HEALTH,
                                                         startup_timeout=llamacpp_peer.STARTUP_TIMEOUT, held=held)))
    return arms


def model_dir_of(name: str) -> str:
    from handler.tools.real_model import QWEN_05B, QWEN_15B, build_real_model
    path = os.path.join(ROOT, ".cache", "models", name)
    spec = {"qwen2.5-coder-0.5b": QWEN_05B, "qwen2.5-coder-1.5b": QWEN_15B}.get(name)
    return build_real_model(path) if spec is None else build_real_model(path, model=spec)


def arm_order(names: list[str], rep: int) -> list[str]:
    """off first on even repetitions, last on odd ones (off, on, on, off, ...)."""
    return list(names) if rep % 2 == 0 else list(reversed(names))


def rep_schedule(names: list[str], reps, fresh: bool) -> list[tuple[int, list[str], bool]]:
    """(repetition, arm order, start servers) per repetition index in `reps`. The order alternates (arm_order); with
    fresh servers every repetition starts its own, in that order, so that neither a server process's
    own speed nor being started first is counted as its arm's every time: it becomes noise across
    repetitions, and the A/A arm (--control) measures that noise."""
    return [(rep, arm_order(names, rep), fresh or i == 0) for i, rep in enumerate(reps)]


def rep_range(a) -> range:
    """The repetitions' indices: from --rep-offset, so that runs split over invocations go on alternating."""
    off = getattr(a, "rep_offset", 0)
    return range(off, off + a.reps)


def start_arms(arms: list["Arm"], bodies: list[dict]) -> None:
    """Start `arms` in this order (all up together), wait for each, warm each up (4 short requests)."""
    for arm in arms:
        arm.server.start()
    for arm in arms:
        arm.server.wait(600)
        if arm.server.error:
            raise NotDriven(f"{arm.server.name} did not start: {arm.server.error}")
        warm = [dict(b, parameters=dict(b["parameters"], max_new_tokens=4)) for b in bodies[:4]]
        run_load(arm.server.api.url(arm.url), warm, 2, progress=False, api=arm.server.api)


def run_system(arms: list[Arm], name: str, wname: str, bodies: list[dict], clients: list[int], a,
               results: dict) -> None:
    by_name = {arm.name: arm for arm in arms}
    try:
        for rep, names, start in rep_schedule(list(by_name), rep_range(a), not getattr(a, "keep_servers", False)):
            if start:
                for arm in arms:
                    arm.server.stop()
                start_arms([by_name[n] for n in names], bodies)
            for c in clients:
                mine = bodies[:max(a.min_requests, a.requests_per_client * c)]
                for arm_name in names:
                    arm = by_name[arm_name]
                    before = arm.counters()
                    recs, dur = run_load(arm.server.api.url(arm.url), mine, c, progress=False, api=arm.server.api)
                    acc = delta(arm.counters(), before)
                    s = summarise(recs, c, dur)
                    row = {"model": name, "workload": wname, "clients": c, "rep": rep, "system": arm.system,
                           "arm": arm_name, "requests": len(mine), "position": names.index(arm_name),
                           **{k: s.get(k) for k in (
                               "requests_per_s", "output_tokens_per_s", "tpot_p50", "tpot_p90",
                               "ttft_p50", "errors", "output_tokens")}, "spec": acc}
                    results["runs"].append(row)
                    ng = acc.get(arm.method, {})
                    extra = ""
                    if ng.get("acceptance_rate") is not None:
                        extra += f", acceptance {ng['acceptance_rate']:.2f}"
                    if ng.get("mean_tokens_per_verify") is not None:
                        extra += f", {ng['mean_tokens_per_verify']:.2f} tokens/verify"
                    print(f"{name} {wname} @{c} rep {rep + 1} {arm.system} {arm_name}: "
                          f"{s['requests_per_s']:.2f} req/s, TPOT p50 {(s['tpot_p50'] or 0) * 1e3:.1f} ms, "
                          f"{s['errors']} errors{extra}", flush=True)
    finally:
        for arm in arms:
            arm.server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--clients", default="1,4,50")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: each workload's own")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens (every system's)")
    ap.add_argument("--lookup-max", type=int, default=4, help="ours: prompt_lookup_max; OpenVINO: max_ngram_size")
    ap.add_argument("--disable-by-batch-size", default="16",
                    help="our speculative arm's disable_by_batch_size (0: never); a comma list (4,8,16) runs one "
                         "speculative arm per value")
    ap.add_argument("--draft-model", default=None,
                    help="the speculative arm's draft model (a --models name or a model dir); default: prompt lookup")
    ap.add_argument("--systems", default="ours", help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--llamacpp-ngram", default="ngram-simple", choices=llamacpp_peer.NGRAM_TYPES,
                    help="llama-server's n-gram proposer (--spec-type)")
    ap.add_argument("--llamacpp-ngram-n", type=int, default=2,
                    help="llama-server's n-gram length looked up (one length; ours tries --lookup-max down to 2)")
    ap.add_argument("--control", action="store_true",
                    help=f"ours: also a second plain server ({CONTROL}), paired with off like a speculative "
                         "arm: its ratio is the server-to-server noise (A/A)")
    ap.add_argument("--keep-servers", action="store_true",
                    help="start each arm's server once for every repetition (default: fresh servers every "
                         "repetition, started in that repetition's order)")
    ap.add_argument("--rep-offset", type=int, default=0,
                    help="the first repetition's index (its arm order): a run split over invocations")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "spec-decode"))
    a = ap.parse_args(argv)
    if a.smoke:
        a.models, a.clients, a.requests_per_client, a.min_requests, a.reps = "smollm2", "1,4", 1, 2, 1
        a.max_new_tokens = a.max_new_tokens or 48
    clients = [int(c) for c in a.clients.split(",")]
    systems = a.systems.split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"--systems: {', '.join(bad)} not among {', '.join(SYSTEMS)}")
    disables = disable_values(a.disable_by_batch_size)
    draft = None
    if a.draft_model:
        draft = model_dir_of(a.draft_model) if a.draft_model in MODELS else a.draft_model
        spec = {"method": "draft_model", "num_speculative_tokens": a.k, "model": draft}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": a.lookup_max}
    specs = our_specs(spec, disables)
    os.makedirs(a.out, exist_ok=True)
    from transformers import AutoTokenizer
    results = {"host": {"machine": platform.machine(), "processor": platform.processor() or platform.node(),
                        "cpus": len(os.sched_getaffinity(0))}, "spec": next(iter(specs.values())),
               "our_arms": specs, "systems": systems, "peers": {}, "not_driven": [], "runs": []}
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
            for system in systems:
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        if system == "ours":
                            arms = our_arms(model, w, specs, a.out, tmp, control=a.control)
                        elif system == "openvino":
                            arms = openvino_arms(model, w, spec["method"], a.k, a.lookup_max, draft, a.out)
                        else:
                            arms = llamacpp_arms(model, w, spec["method"], a.k, a.llamacpp_ngram_n,
                                                 a.llamacpp_ngram, draft, a.out, tok)
                        for arm in arms:
                            if arm.server.held:
                                results["peers"].setdefault(system, {})[arm.name] = arm.server.held
                        run_system(arms, name, wname, bodies, clients, a, results)
                    except NotDriven as e:
                        print(f"{name} {wname} {system}: not driven: {e}", flush=True)
                        results["not_driven"].append({"model": name, "workload": wname, "system": system,
                                                      "why": str(e)})
    md = report(results)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def report(results: dict) -> str:
    """One row per (model, workload, clients, system, speculative arm): the arm and the same system's
    plain arm pooled over repetitions, and on/off ratios; then what could not be driven and why."""
    groups: dict = {}
    for r in results["runs"]:
        groups.setdefault((r["model"], r["workload"], r["clients"], r.get("system", "ours")), {}) \
            .setdefault(r["arm"], []).append(r)

    def mean(rows, k):
        xs = [x[k] for x in rows if x.get(k) is not None]
        return sum(xs) / len(xs) if xs else None

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    h = results["host"]
    method_key = results["spec"]["method"]
    method = {"ngram": "Prompt-lookup", "draft_model": "Draft-model"}[method_key]
    md = (f"# {method} speculative decoding vs plain decoding (paged, fp32, CPU)\n\n"
          f"Host: {h['processor']} ({h['machine']}), {h['cpus']} CPUs. Our speculative arm"
          f"{'s' if len(results.get('our_arms', {})) > 1 else ''}: "
          + ", ".join(f"{n} `option.speculative_config={json.dumps(s)}`"
                      for n, s in (results.get("our_arms") or {"on": results["spec"]}).items()) + ".\n")
    for system, arms in sorted(results.get("peers", {}).items()):
        if "on" in arms and "speculative" in arms["on"]:
            md += f"{SYSTEM_NAMES.get(system, system)}'s speculative arm: `{json.dumps(arms['on']['speculative'])}`.\n"
    md += ("\n| model | workload | clients | system | arm | TPOT p50 off / on ms | ratio | req/s off / on | ratio | "
           "acceptance | tokens / verify |\n|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|\n")
    for (model, wl, c, system), arms in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1], g[0][2],
                                                                               SYSTEMS.index(g[0][3])
                                                                               if g[0][3] in SYSTEMS else 9)):
        off = arms.get("off", [])
        t0, r0 = mean(off, "tpot_p50"), mean(off, "requests_per_s")
        for arm_name in sorted(n for n in arms if n != "off"):
            on = arms[arm_name]
            t1, r1 = mean(on, "tpot_p50"), mean(on, "requests_per_s")
            ng = [x["spec"].get(method_key, {}) for x in on]
            prop, acc, ver = (sum(x.get(k, 0) for x in ng) for k in ("proposed", "accepted", "verifies"))
            tpv = fmt((acc + ver) / ver if ver else None, ".2f")
            if system == "openvino" and ver:
                tpv += " †"
            md += (f"| {model} | {wl} | {c} | {SYSTEM_NAMES.get(system, system)} | {arm_name} | "
                   f"{fmt(t0 and t0 * 1e3, '.1f')} / {fmt(t1 and t1 * 1e3, '.1f')} | "
                   f"{fmt(t1 / t0 if t0 and t1 else None, '.2f')} | {fmt(r0, '.2f')} / {fmt(r1, '.2f')} | "
                   f"{fmt(r1 / r0 if r0 and r1 else None, '.2f')} | {fmt(acc / prop if prop else None, '.2f')} | "
                   f"{tpv} |\n")
    if any(r["arm"] == CONTROL for r in results["runs"]):
        md += (f"\n{CONTROL}: a second plain server beside off (A/A): its ratios are what two servers of the same "
               "configuration differ by on this host, the floor under which an arm's ratio is not a finding.\n")
    if any(r.get("system") == "openvino" for r in results["runs"]):
        md += ("\n† OpenVINO GenAI's step API does not expose its proposal counts: tokens per step a request got "
               "after its first token, steps without a proposal included (a lower bound of tokens per verify); "
               "no acceptance rate.\n")
    if results.get("not_driven"):
        md += "\n## Not driven\n\n| model | workload | system | why |\n|---|---|---|---|\n"
        for nd in results["not_driven"]:
            md += f"| {nd['model']} | {nd['workload']} | {SYSTEM_NAMES.get(nd['system'], nd['system'])} | " \
                  f"{nd['why'].replace('|', '/')} |\n"
    return md


if __name__ == "__main__":
    sys.exit(main())
