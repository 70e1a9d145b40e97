"""/metrics through a real client's parser (prometheus_client.parser) against the requests sent,
the per-request log line, request ids, and the Grafana dashboard's series."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from handler.engine.loop import DoneEvent, ErrorEvent, TokenEvent
from handler.engine.request import SamplingParams
from handler.http.metrics import Metrics, RequestTrace, priority_label, request_id
from tests.support.server import Server

PAGED = ("option.rolling_batch=lmi-dist\noption.paged_attention=true\noption.max_rolling_batch_size=4\n"
         "option.kv_cache_tokens=2048\noption.block_size=8\noption.log_format=json\n")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "x", "The quick brown fox jumps over the lazy dog. " * 3]
NEW = [7, 3, 12, 5]


def scrape(url: str) -> dict:
    """{sample name: {frozenset(labels minus model/strategy): value}} from a real parser."""
    out: dict = {}
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model", "strategy"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def settled(url: str, before: dict, n: int) -> dict:
    """The scrape once n more requests are recorded (a request is recorded when its response
    closes, which may be just after the client has read the last byte)."""
    def total(m):
        return sum(m.get("lmi_requests_total", {}).values())
    deadline = time.time() + 15
    while True:
        m = scrape(url)
        if total(m) >= total(before) + n or time.time() > deadline:
            return m
        time.sleep(0.05)


def one(m: dict, name: str, **labels) -> float:
    return m[name][frozenset(labels.items())]


def log_lines(srv) -> list[dict]:
    out = []
    for ln in srv.output().splitlines():
        if ln.startswith("{"):
            rec = json.loads(ln)
            if rec.get("logger") == "lmi.request":
                out.append(rec)
    return out


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    srv = Server(PAGED, demo_model_dir, tmp_path_factory.mktemp("metrics"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.mark.slow
def test_histogram_counts_match_the_requests_sent(server, tokenizer):
    before = scrape(server.url)
    bodies = [{"inputs": p, "parameters": {"max_new_tokens": n, "ignore_eos": True}} for p, n in zip(PROMPTS, NEW)]
    streams = [dict(b, stream=True) for b in bodies[:2]]
    listed = {"inputs": PROMPTS[2:], "parameters": {"max_new_tokens": 4, "ignore_eos": True}}

    def send(body):
        r = server.post(body)
        assert r.status_code == 200, r.text
        return r

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(send, bodies + streams + [listed]))
    bad = server.post({"inputs": "x", "parameters": {"max_new_tokens": 0}})
    too_long = server.post({"inputs": "x " * 5000, "parameters": {"max_new_tokens": 2}})
    assert bad.status_code == 400 and too_long.status_code == 400
    after = settled(server.url, before, len(bodies) + len(streams) + 3)

    def delta(name, **labels):
        return one(after, name, **labels) - before.get(name, {}).get(frozenset(labels.items()), 0.0)

    http_ok = len(bodies) + len(streams) + 1
    seqs = len(bodies) + len(streams) + len(listed["inputs"])
    assert delta("lmi_requests_total", outcome="ok", code="200") == http_ok
    assert delta("lmi_requests_total", outcome="bad_request", code="400") == 1
    assert delta("lmi_requests_total", outcome="too_long", code="400") == 1
    assert delta("lmi_e2e_request_latency_seconds_count") == http_ok
    for h in ("lmi_time_to_first_token_seconds", "lmi_time_per_output_token_seconds",
              "lmi_request_queue_time_seconds", "lmi_request_prompt_tokens", "lmi_request_generation_tokens"):
        assert delta(h + "_count") == seqs, h
    # Lengths against the tokenizer and what was asked for (ignore_eos: exactly max_new_tokens).
    prompts = PROMPTS + PROMPTS[:2] + PROMPTS[2:]
    assert delta("lmi_request_prompt_tokens_sum") == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert delta("lmi_request_generation_tokens_sum") == sum(NEW) + sum(NEW[:2]) + 4 * 2
    assert delta("lmi_generated_tokens_total") == sum(NEW) + sum(NEW[:2]) + 4 * 2
    # Every step's tokens are the engine's prefill + decode tokens.
    assert delta("lmi_step_tokens_sum") == delta("lmi_prefill_tokens_total") + delta("lmi_decode_tokens_total")
    assert delta("lmi_step_tokens_count") == delta("lmi_steps_total") > 0
    # Buckets are cumulative and end at the count.
    for h in ("lmi_time_to_first_token_seconds", "lmi_e2e_request_latency_seconds"):
        b = sorted(((float(dict(k)["le"]), v) for k, v in after[h + "_bucket"].items()))
        assert all(x[1] <= y[1] for x, y in zip(b, b[1:])) and b[-1] == (float("inf"), one(after, h + "_count"))
    assert one(after, "lmi_running") == 0 and one(after, "lmi_waiting") == 0


@pytest.mark.slow
def test_every_protocol_is_counted(server, tokenizer):
    """OpenAI and TGI routes go through the same trace: their requests land in the same series."""
    before = scrape(server.url)
    chat = requests.post(server.url + "/v1/completions", timeout=60,
                         json={"model": "demo", "prompt": "def g(", "max_tokens": 5, "stream": True})
    tgi = requests.post(server.url + "/generate", timeout=60,
                        json={"inputs": "x = ", "parameters": {"max_new_tokens": 4}})
    bad = requests.post(server.url + "/generate", timeout=60, json={"inputs": "x", "parameters": {"top_p": 7}})
    assert chat.status_code == tgi.status_code == 200 and bad.status_code == 422
    after = settled(server.url, before, 3)

    def delta(name, **labels):
        return one(after, name, **labels) - before.get(name, {}).get(frozenset(labels.items()), 0.0)

    assert delta("lmi_requests_total", outcome="ok", code="200") == 2
    assert delta("lmi_requests_total", outcome="bad_request", code="422") == 1
    assert delta("lmi_time_to_first_token_seconds_count") == 2
    assert delta("lmi_request_prompt_tokens_sum") == sum(len(tokenizer(p)["input_ids"]) for p in ("def g(", "x = "))
    assert tgi.headers["X-Request-Id"] and chat.headers["X-Request-Id"]


@pytest.mark.slow
def test_server_side_ttft_and_latency_sit_inside_the_clients(server):
    """One streamed request alone: the server's TTFT and end-to-end time are within the client's."""
    before = scrape(server.url)
    t0 = time.perf_counter()
    with requests.post(server.url + "/invocations", stream=True, timeout=60,
                       json={"inputs": "abc", "stream": True, "parameters": {"max_new_tokens": 20, "ignore_eos": True}}) as r:
        lines = r.iter_lines(chunk_size=None)
        next(ln for ln in lines if ln)
        client_ttft = time.perf_counter() - t0
        n = 1 + sum(1 for ln in lines if ln)
    client_total = time.perf_counter() - t0
    after = settled(server.url, before, 1)
    d = {h: one(after, h + "_sum") - before[h + "_sum"][frozenset()]
         for h in ("lmi_time_to_first_token_seconds", "lmi_e2e_request_latency_seconds",
                   "lmi_time_per_output_token_seconds")}
    assert n == 20
    assert 0 < d["lmi_time_to_first_token_seconds"] <= client_ttft
    assert d["lmi_time_to_first_token_seconds"] < d["lmi_e2e_request_latency_seconds"] <= client_total
    assert 0 < d["lmi_time_per_output_token_seconds"] * 19 < client_total


@pytest.mark.slow
def test_request_id_header_and_json_log_line(server, tokenizer):
    body = {"inputs": "import json", "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
    amzn = server.post(body, headers={"X-Amzn-RequestId": "7f0c-amzn-1"})
    plain = server.post(body, headers={"X-Request-Id": "client.id-42"})
    fresh = server.post(body)
    unsafe = server.post(body, headers={"X-Request-Id": "a b\tc" + "x" * 200})
    assert amzn.headers["X-Amzn-RequestId"] == amzn.headers["X-Request-Id"] == "7f0c-amzn-1"
    assert plain.headers["X-Request-Id"] == "client.id-42" and "X-Amzn-RequestId" not in plain.headers
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["X-Request-Id"])
    assert re.fullmatch(r"[0-9a-f]{32}", unsafe.headers["X-Request-Id"])
    deadline = time.time() + 10
    while time.time() < deadline:           # the line is written when the response closes
        by_id = {r["request_id"]: r for r in log_lines(server)}
        if "7f0c-amzn-1" in by_id and "client.id-42" in by_id:
            break
        time.sleep(0.1)
    rec = by_id["7f0c-amzn-1"]
    assert rec["status"] == 200 and rec["outcome"] == "ok" and rec["strategy"] == "paged"
    assert rec["prompt_tokens"] == len(tokenizer("import json")["input_ids"])
    assert rec["output_tokens"] == 6 and rec["finish_reason"] == "length" and rec["preemptions"] == 0
    assert 0 <= rec["queue_ms"] <= rec["ttft_ms"] <= rec["total_ms"]
    assert by_id["client.id-42"]["output_tokens"] == 6


@pytest.mark.slow
def test_dashboard_queries_only_series_the_server_exports(server):
    from handler.tools.bench.dashboard import DASHBOARD_PATH, build_dashboard, metric_names

    with open(DASHBOARD_PATH) as f:
        committed = json.load(f)
    assert committed == build_dashboard(), "regenerate: python -m handler.tools.bench.dashboard"
    exported = set(scrape(server.url))
    missing = sorted(n for n in metric_names(committed) if n not in exported)
    assert not missing and len(metric_names(committed)) >= 10, missing


# ---- the trace's outcome logic on hand-made events (no server)
class _Ch:
    def __init__(self, n_prompt, priority=0):
        self.prompt_ids = [0] * n_prompt
        self.params = SamplingParams(priority=priority)


def _trace():
    m = Metrics("m", "paged")
    return m, RequestTrace(m, "id", start=time.monotonic())


def _count(m, outcome, code):
    return m.registry.get_sample_value("lmi_requests_total", {"model": "m", "strategy": "paged",
                                                              "outcome": outcome, "code": code})


def test_trace_outcomes():
    done = DoneEvent("length", "ab", 2, 3, queue_time_s=0.01, preemptions=1)
    now = time.monotonic()
    # ok: timings from the events' own times, noted as the route reads them
    m, t = _trace()
    t.watch([_Ch(3)])
    t.note(0, TokenEvent(1, "a", -1.0, time=now + 0.1))
    t.note(0, TokenEvent(2, "b", -1.0, done=done, time=now + 0.4))
    f = t.finish(200)
    assert f["outcome"] == "ok" and f["preemptions"] == 1 and f["output_tokens"] == 2
    assert _count(m, "ok", "200") == 1 and t.finish(200) == {} and _count(m, "ok", "200") == 1
    labels = {"model": "m", "strategy": "paged"}
    assert m.registry.get_sample_value("lmi_time_per_output_token_seconds_sum", labels) == pytest.approx(0.3)
    # a stream that timed out (the route's ErrorEvent(504)), one whose client left, one whose model failed
    for events, outcome, code in (([ErrorEvent(504, "request timed out")], "timeout", "504"),
                                  ([TokenEvent(1, "a", -1.0, time=now)], "aborted", "499"),
                                  ([ErrorEvent(424, "boom")], "model_failure", "424")):
        m, t = _trace()
        t.watch([_Ch(1)])
        for ev in events:
            t.note(0, ev)
        assert t.finish(200)["outcome"] == outcome and _count(m, outcome, code) == 1
        assert m.registry.get_sample_value("lmi_time_to_first_token_seconds_count", labels) == 0


def test_request_id_sources():
    assert request_id({"X-Amzn-RequestId": "a", "X-Request-Id": "b"}) == ("a", "X-Amzn-RequestId")
    assert request_id({"X-Request-Id": "b"}) == ("b", "X-Request-Id")
    rid, src = request_id({"X-Request-Id": "bad id"})
    assert src is None and re.fullmatch(r"[0-9a-f]{32}", rid)


@pytest.mark.slow
def test_bench_run_reports_server_side_figures_from_scrapes(server, tmp_path):
    """`bench run` scrapes /metrics: its server-side counts are the requests it sent, and the
    server's mean TTFT/latency sit inside the client's (the difference is the HTTP/network share)."""
    import gzip
    import subprocess
    import sys

    from tests.support.server import ROOT

    out, scrapes, png = tmp_path / "run.json", tmp_path / "scrapes.json.gz", tmp_path / "panels.png"
    p = subprocess.run([sys.executable, "-m", "handler", "bench", "run", "--url", server.url, "--preset", "smoke",
                        "--workload", "smoke", "--scrape-interval", "0.2", "--out", str(out),
                        "--scrape-out", str(scrapes), "--plot", str(png), "--no-progress"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "server (/metrics) vs client" in p.stdout
    run = json.loads(out.read_text())
    srv, client, recs = run["server"], run["result"], run["records"]
    assert srv["ttft_count"] == srv["tpot_count"] == srv["latency_count"] == client["completed"] == 6
    client_ttft = sum(r["ttft"] for r in recs) / len(recs)
    client_latency = sum(r["end"] - r["start"] for r in recs) / len(recs)
    assert 0 < srv["ttft_mean"] <= client_ttft and 0 < srv["latency_mean"] <= client_latency
    with gzip.open(scrapes, "rt") as f:
        series = json.load(f)["series"]
    assert len(series) == srv["scrapes"] >= 2 and png.stat().st_size > 10_000


def test_histogram_quantile_matches_the_observations():
    """Bucket-estimated quantiles (as Prometheus computes them) land in the bucket that holds the
    exact quantile of the raw observations; prometheus_client does the bucketing."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from handler.tools.bench.dashboard import histogram_quantile
    from handler.tools.bench.scrape import parse

    rng = random.Random(7)
    xs = [rng.lognormvariate(-3, 0.8) for _ in range(2000)]
    reg = CollectorRegistry()
    bounds = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)
    h = Histogram("lmi_x_seconds", "x", buckets=bounds, registry=reg)
    for x in xs:
        h.observe(x)
    from prometheus_client import generate_latest
    buckets = [(float(dict(k)["le"]), v) for k, v in parse(generate_latest(reg).decode())["lmi_x_seconds_bucket"].items()]
    for q in (0.1, 0.5, 0.9, 0.99):
        exact = sorted(xs)[int(q * len(xs))]
        est = histogram_quantile(q, buckets)
        edges = (0.0,) + bounds + (float("inf"),)
        i = next(i for i in range(len(edges) - 1) if edges[i] < exact <= edges[i + 1])
        assert edges[i] <= est <= edges[i + 1], (q, exact, est)
    assert histogram_quantile(0.5, [(0.1, 0), (float("inf"), 0)]) != histogram_quantile(0.5, [])  # NaN != NaN
    assert histogram_quantile(0.99, [(0.1, 1), (float("inf"), 10)]) == 0.1  # in +Inf: the last finite bound


def test_queue_time_by_priority_and_bounded_priority_labels():
    done = DoneEvent("length", "ab", 2, 3, queue_time_s=0.25)
    now = time.monotonic()
    m = Metrics("m", "paged")
    for p in (-1, -1, 3, 10**6):
        t = RequestTrace(m, "id", start=now)
        t.watch([_Ch(2, priority=p)])
        t.note(0, TokenEvent(1, "a", -1.0, done=done, time=now + 0.1))
        t.finish(200)

    def count(label):
        return m.registry.get_sample_value("lmi_request_queue_time_by_priority_seconds_count",
                                           {"model": "m", "strategy": "paged", "priority": label})
    assert (count("-1"), count("3"), count(">=10"), count("0")) == (2, 1, 1, None)
    assert m.registry.get_sample_value("lmi_request_queue_time_by_priority_seconds_sum",
                                       {"model": "m", "strategy": "paged", "priority": "-1"}) == pytest.approx(0.5)
    assert [priority_label(p) for p in (-10, -9, 0, 9, 10)] == ["<=-10", "-9", "0", "9", ">=10"]
