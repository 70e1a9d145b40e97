"""Flood and soak figures: hostile input and overload (bounded; loopback only; starts its own servers).

  python benchmarks/flood.py --model-dir DIR [--seconds 20] [--clients 8] [--flood-factor 10]

1. goodput: C closed-loop clients for S seconds alone, then the same C clients while
   flood-factor x C flooders send back-to-back requests (a separate process, so the flooders
   do not share the clients' interpreter). Reported: successful requests/s of the C clients
   in each phase, and their ratio, plus the flooders' refusals/s.
2. memory: the worker's RSS before and after a 50 MB body (sent chunked, no length declared).
3. KV: lmi_kv_tokens_allocated once everything has finished (should be 0).
4. seeds: R concurrent repeats of one seeded sampling request, each beside different noise
   requests, with option.batch_invariant=true and without; distinct answers in each mode.
Prints one JSON object. Build a model first: `python -m handler build-demo-model DIR`.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from handler.tools.bench import scrape  # noqa: E402
from handler.tools.bench.client import wait_ready  # noqa: E402
from handler.tools.bench.compare import free_port  # noqa: E402

GOOD = {"inputs": "def handler(event, context):", "parameters": {"max_new_tokens": 16, "ignore_eos": True}}


class Server:
    """`python -m handler serve` in a child process (also benchmarks/chaos.py's); TAG names its files."""
    TAG = "flood"

    def __init__(self, model_dir: str, props: str, log_dir: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.path.join(log_dir, f"{self.TAG}-{self.port}.properties")
        with open(path, "w") as f:
            f.write(props)
        self.log = open(os.path.join(log_dir, f"{self.TAG}-{self.port}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "handler", "serve", "--properties", path, "--model-dir", model_dir,
             "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        wait_ready(self.url, 300, self.proc)

    def metric(self, name: str) -> float:
        """One series (summed over its labels) from /metrics, parsed as the bench parses it."""
        return sum(scrape.parse(requests.get(self.url + "/metrics", timeout=30).text)[name].values())

    def worker(self) -> int:
        pid = self.proc.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return int(f.read().split()[0])

    def worker_rss_mb(self) -> float:
        with open(f"/proc/{self.worker()}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024

    def worker_cpu_s(self) -> float:
        with open(f"/proc/{self.worker()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()



def _run_threads(target, n: int) -> float:
    """Run `target` in n threads until all return; the seconds it took."""
    threads = [threading.Thread(target=target) for _ in range(n)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.time() - t0

def closed_loop(url: str, body: dict, clients: int, seconds: float) -> dict:
    ok, refused, other = [0], [0], [0]
    lock = threading.Lock()
    end = time.time() + seconds

    def client():
        with requests.Session() as s:
            while time.time() < end:
                try:
                    code = s.post(url + "/invocations", json=body, timeout=120).status_code
                except requests.RequestException:
                    code = -1
                with lock:
                    (ok if code == 200 else refused if code == 503 else other)[0] += 1

    took = _run_threads(client, clients)
    return {"ok_per_s": ok[0] / took, "refused_per_s": refused[0] / took, "other": other[0], "ok": ok[0]}


def _flood_process(port, clients, seconds, out):
    """Flooders: keep-alive connections sending the good clients' request back-to-back (bytes
    built once: a flooder costs the machine as little as possible besides the server's work)."""
    import http.client

    body = json.dumps(GOOD).encode()
    counts = {"ok": 0, "refused": 0, "other": 0}
    lock = threading.Lock()
    end = time.time() + seconds

    def flooder():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.time() < end:
            try:
                conn.request("POST", "/invocations", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                key = "ok" if resp.status == 200 else "refused" if resp.status == 503 else "other"
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                key = "other"
            with lock:
                counts[key] += 1

    took = _run_threads(flooder, clients)
    out.put({"ok_per_s": counts["ok"] / took, "refused_per_s": counts["refused"] / took,
             "other": counts["other"], "ok": counts["ok"]})


def goodput(srv: Server, clients: int, factor: int, seconds: float) -> dict:
    """Goodput = successful requests/s, all clients together (flooders send the same request,
    so an admitted one is as useful); unflooded: C clients; flooded: C + factor*C."""
    closed_loop(srv.url, GOOD, clients, 3)          # warm-up
    cpu0 = srv.worker_cpu_s()
    alone = closed_loop(srv.url, GOOD, clients, seconds)
    cpu_alone = srv.worker_cpu_s() - cpu0
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    flooder = ctx.Process(target=_flood_process, args=(srv.port, clients * factor, seconds + 4, q))
    flooder.start()
    time.sleep(2)                                   # the flood is running when we start
    cpu0 = srv.worker_cpu_s()
    flooded = closed_loop(srv.url, GOOD, clients, seconds)
    cpu_flooded = srv.worker_cpu_s() - cpu0
    flood = q.get(timeout=seconds + 300)
    flooder.join(60)
    total = flooded["ok_per_s"] + flood["ok_per_s"]
    refusals = (flooded["refused_per_s"] + flood["refused_per_s"]) * seconds
    return {"clients": clients, "flooders": clients * factor, "unflooded": alone, "flooded_clients": flooded,
            "flooders_result": flood, "goodput_unflooded": alone["ok_per_s"], "goodput_flooded": total,
            "goodput_ratio": total / max(alone["ok_per_s"], 1e-9),
            "refusals_per_s": flooded["refused_per_s"] + flood["refused_per_s"],
            "server_cpu_s": {"unflooded": round(cpu_alone, 2), "flooded": round(cpu_flooded, 2)},
            # Upper bound: all the server's CPU time beyond the unflooded phase's, per refusal.
            "server_cpu_us_per_refusal": round(1e6 * max(0.0, cpu_flooded - cpu_alone) / max(refusals, 1), 1)}


def big_body(srv: Server) -> dict:
    before = srv.worker_rss_mb()
    t0 = time.time()
    r = requests.post(srv.url + "/invocations", data=(b"x" * (1 << 20) for _ in range(50)),
                      headers={"Content-Type": "application/json"}, timeout=300)
    return {"status": r.status_code, "seconds": round(time.time() - t0, 2),
            "rss_mb_before": round(before, 1), "rss_mb_after": round(srv.worker_rss_mb(), 1)}


def seeded_repeats(srv: Server, repeats: int) -> dict:
    seeded = {"inputs": "def sample(x):", "parameters": {"max_new_tokens": 24, "do_sample": True,
                                                          "temperature": 1.0, "seed": 1234}}
    answers, lock = [], threading.Lock()

    def one(i):
        noise = {"inputs": f"class Noise{i}:" * (1 + i % 5),
                 "parameters": {"max_new_tokens": 8 + i % 17, "do_sample": True, "temperature": 1.2}}
        t = threading.Thread(target=lambda: requests.post(srv.url + "/invocations", json=noise, timeout=300))
        t.start()
        text = requests.post(srv.url + "/invocations", json=seeded, timeout=300).json()["generated_text"]
        t.join()
        with lock:
            answers.append(text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(repeats)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"repeats": repeats, "distinct_answers": len(set(answers))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--seconds", type=float, default=20.0, help="length of each goodput phase")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--flood-factor", type=int, default=10)
    p.add_argument("--repeats", type=int, default=24, help="seeded repeats per mode")
    p.add_argument("--strategy-props", default="option.rolling_batch=auto\noption.paged_attention=true\n"
                   "option.max_rolling_batch_size=8\njob_queue_size=8\n")
    a = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        srv = Server(a.model_dir, a.strategy_props, tmp)
        try:
            out["goodput"] = goodput(srv, a.clients, a.flood_factor, a.seconds)
            out["big_body"] = big_body(srv)
            time.sleep(1)
            out["kv_tokens_allocated_after"] = srv.metric("lmi_kv_tokens_allocated")
            out["client_disconnects"] = srv.metric("lmi_http_client_disconnects_total")
        finally:
            out["exit_code"] = srv.stop()
        for mode in ("true", "false"):
            srv = Server(a.model_dir, f"option.rolling_batch=auto\noption.batch_invariant={mode}\n", tmp)
            try:
                out[f"seeded_batch_invariant_{mode}"] = seeded_repeats(srv, a.repeats)
            finally:
                srv.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
