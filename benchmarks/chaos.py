"""Chaos figures: worker death, engine faults, slow clients (bounded; loopback; starts its own servers).

  python benchmarks/chaos.py [--model-dir DIR] [--out benchmarks/results/chaos/chaos.json]

1. worker death: a stream is running when the worker is SIGKILLed (as an OOM kill or a segfault
   would); reported: seconds until the client's stream ends, until /ping answers 200 again (the
   master's replacement has loaded the model), and whether the replacement's greedy text equals
   the first worker's. Repeated --kills times.
2. slow clients: 150 connections trickle header bytes (one every second) while a client sends
   normal requests one after another; their latency (p50/p90) against the same requests alone.
3. long prompt: short streamed requests arrive every 0.1 s; their time to first token (p50/p90)
   alone, and while one --long-tokens prompt (30k) is prefilled in chunks of
   option.max_rolling_batch_prefill_tokens.

The model: --model-dir, else a tiny random Llama built here with 32k positions (the long prompt
needs them; its timings are the server's, not a real model's). Prints and writes one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.flood import Server as FloodServer  # noqa: E402

GREEDY = {"inputs": "The three primary colors are", "parameters": {"max_new_tokens": 16, "do_sample": False}}


class Server(FloodServer):
    TAG = "chaos"

    def post(self, body: dict, timeout: float = 300) -> requests.Response:
        return requests.post(self.url + "/invocations", json=body, timeout=timeout)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_s": round(statistics.median(xs), 4), "p90_s": round(pct(xs, 0.9), 4),
            "max_s": round(max(xs), 4)}


# ------------------------------------------------------------------ 1. worker death
def worker_death(srv: Server, kills: int) -> dict:
    want = srv.post(GREEDY).json()["generated_text"]
    runs = []
    for _ in range(kills):
        worker = srv.worker()
        r = requests.post(srv.url + "/invocations", stream=True, timeout=120, json={
            "inputs": "Once upon a time", "stream": True, "parameters": {"max_new_tokens": 800, "ignore_eos": True}})
        lines = r.iter_lines()
        next(lines)
        ended = {}

        def drain():
            try:
                for _ in lines:
                    pass
            except requests.RequestException:
                pass
            ended["t"] = time.monotonic()

        t = threading.Thread(target=drain)
        t.start()
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        t.join(30)
        seen = set()
        while True:
            try:
                code = requests.get(srv.url + "/ping", timeout=2).status_code
            except requests.RequestException:
                code = "refused"
            seen.add(code)
            if code == 200:
                break
            if time.monotonic() - killed > 300:
                raise RuntimeError("no replacement worker within 300 s")
            time.sleep(0.05)
        ready = time.monotonic() - killed
        runs.append({"stream_closed_after_s": round(ended.get("t", float("nan")) - killed, 3),
                     "ping_200_after_s": round(ready, 3), "ping_seen": sorted(map(str, seen)),
                     "same_greedy_text": srv.post(GREEDY).json()["generated_text"] == want,
                     "new_worker": srv.worker() != worker})
    return {"runs": runs, "ping_200_after_s_max": max(r["ping_200_after_s"] for r in runs)}


# ------------------------------------------------------------------ 2. slow clients
def slow_clients(srv: Server, n_slow: int, n_requests: int) -> dict:
    body = {"inputs": "def handler(event, context):", "parameters": {"max_new_tokens": 16, "ignore_eos": True}}

    def latencies() -> list[float]:
        out = []
        for _ in range(n_requests):
            t0 = time.monotonic()
            assert srv.post(body).status_code == 200
            out.append(time.monotonic() - t0)
        return out

    srv.post(body)
    alone = latencies()
    socks, stop = [], threading.Event()
    for _ in range(n_slow):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)

    def trickle():
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            stop.wait(1.0)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        among = latencies()
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()
    return {"slow_clients": n_slow, "alone": summary(alone), "among_slow_clients": summary(among),
            "p90_ratio": round(pct(among, 0.9) / pct(alone, 0.9), 3)}


# ------------------------------------------------------------------ 3. long prompt
def ttft(srv: Server, n_short: int, gap_s: float) -> list[float]:
    out: list[float] = []
    lock = threading.Lock()

    def one(i: int):
        t0 = time.monotonic()
        r = requests.post(srv.url + "/invocations", stream=True, timeout=600, json={
            "inputs": f"Request {i}: the weather today is", "stream": True,
            "parameters": {"max_new_tokens": 8, "ignore_eos": True}})
        lines = r.iter_lines()
        next(lines)
        with lock:
            out.append(time.monotonic() - t0)
        for _ in lines:
            pass

    threads = []
    for i in range(n_short):
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(gap_s)
    for t in threads:
        t.join(600)
    return out


def long_prompt(srv: Server, model_dir: str, long_tokens: int, n_short: int) -> dict:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    words = "the quick brown fox jumps over a lazy dog and runs far away "
    reps = long_tokens // max(1, len(tok(words)["input_ids"])) + 1
    while len(tok(words * reps)["input_ids"]) < long_tokens:     # tokens do not add up exactly
        reps += max(1, reps // 50)
    text = words * reps
    n_long = len(tok(text)["input_ids"])
    ttft(srv, 4, 0.05)          # warm
    alone = ttft(srv, n_short, 0.1)
    box = {}

    def long_one():
        t0 = time.monotonic()
        r = srv.post({"inputs": text, "parameters": {"max_new_tokens": 1}}, timeout=900)
        box["status"], box["s"] = r.status_code, time.monotonic() - t0

    t = threading.Thread(target=long_one)
    t.start()
    time.sleep(0.3)             # its prefill has begun
    beside = ttft(srv, n_short, 0.1)
    t.join(900)
    return {"long_prompt_tokens": n_long, "long_request": {"status": box.get("status"),
                                                           "latency_s": round(box.get("s", float("nan")), 3)},
            "short_ttft_alone": summary(alone), "short_ttft_beside_long": summary(beside),
            "p90_ratio": round(pct(beside, 0.9) / pct(alone, 0.9), 3)}


def build_model(tmp: str) -> str:
    from handler.tools.demo_model import build_demo_model
    d = build_demo_model(os.path.join(tmp, "tiny-32k"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 32768
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--slow", type=int, default=150)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--long-tokens", type=int, default=30000)
    p.add_argument("--short", type=int, default=20)
    p.add_argument("--prefill-tokens", type=int, default=1024, help="option.max_rolling_batch_prefill_tokens")
    p.add_argument("--parts", default="death,slow,long", help="which of death, slow, long to run")
    p.add_argument("--out")
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    tmp = tempfile.mkdtemp(prefix="chaos-")
    model_dir = a.model_dir or build_model(tmp)
    props = ("option.rolling_batch=auto\noption.max_rolling_batch_size=32\noption.device=cpu\n"
             f"option.max_rolling_batch_prefill_tokens={a.prefill_tokens}\n"
             f"option.max_model_len={a.long_tokens + 1024}\n")
    result = {"model_dir": model_dir if a.model_dir else "tiny random Llama (handler.tools.demo_model), 32k positions",
              "properties": props.strip().split("\n"), "host_cpus": os.cpu_count(),
              "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    srv = Server(model_dir, props, tmp)
    try:
        if "death" in parts:
            result["worker_death"] = worker_death(srv, a.kills)
            print(json.dumps(result["worker_death"]), file=sys.stderr)
        if "slow" in parts:
            result["slow_clients"] = slow_clients(srv, a.slow, a.requests)
            print(json.dumps(result["slow_clients"]), file=sys.stderr)
        if "long" in parts:
            result["long_prompt"] = long_prompt(srv, model_dir, a.long_tokens, a.short)
    finally:
        srv.stop()
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]   # a shared host: other work counts
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
