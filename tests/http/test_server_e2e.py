"""End to end over real HTTP (gunicorn on loopback): greedy parity with `model.generate` for every
strategy under concurrent load, the response schema, streaming, errors, queue limits, time-outs."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.reference import hf_greedy, tokenizer
from tests.support.server import Server

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Parser(object):\n    \"\"\"Parse a file.\"\"\"\n\n    def __init__(self, path, encoding='utf-8'):\n"
    "        self.path = path\n        self.encoding = encoding\n",
    "x",
    "# Copyright 2001 Python Software Foundation. All rights reserved.\n" * 6,
    "for i in range(10):\n    print(i)",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "return",
]
NEW_TOKENS = [5, 17, 33, 2, 24, 9, 40, 12]

STRATEGY_FILES = {
    "none": "engine=Python\noption.rolling_batch=disable\n",
    "dynamic": "engine=Python\nbatch_size=4\nmax_batch_delay=50\n",
    "rolling": "engine=MPI\noption.rolling_batch=auto\noption.paged_attention=false\n"
               "option.max_rolling_batch_size=4\noption.max_rolling_batch_prefill_tokens=64\n"
               "option.kv_cache_tokens=1024\n",
    "paged": "engine=MPI\noption.rolling_batch=lmi-dist\noption.paged_attention=true\n"
             "option.max_rolling_batch_size=6\noption.max_rolling_batch_prefill_tokens=48\n"
             "option.kv_cache_tokens=320\noption.block_size=8\n",
}


@pytest.fixture(scope="module", params=list(STRATEGY_FILES))
def server(request, demo_model_dir, tmp_path_factory):
    srv = Server(STRATEGY_FILES[request.param], demo_model_dir, tmp_path_factory.mktemp("srv"))
    srv.strategy = request.param
    yield srv
    srv.stop()


def test_ping_reports_strategy(server):
    r = requests.get(server.url + "/ping", timeout=5)
    assert r.status_code == 200 and r.json()["strategy"] == server.strategy


def test_greedy_parity_under_concurrent_load(server, demo_model_dir):
    def one(i):
        body = {"inputs": PROMPTS[i], "parameters": {"max_new_tokens": NEW_TOKENS[i], "details": True}}
        r = server.post(body)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, range(len(PROMPTS))))
    for prompt, n, res in zip(PROMPTS, NEW_TOKENS, results):
        want = hf_greedy(demo_model_dir, prompt, n)
        got = [t["id"] for t in res["details"]["tokens"]]
        assert got == want, f"{server.strategy}: prompt {prompt[:20]!r}"
        d = res["details"]
        assert d["generated_tokens"] == len(want)
        assert d["finish_reason"] == ("eos_token" if len(want) < n else "length")
        assert res["generated_text"] == "".join(t["text"] for t in d["tokens"])


def test_parity_with_repetition_penalty_and_client_side_batch(server, demo_model_dir):
    body = {"inputs": PROMPTS[:3], "parameters": {"max_new_tokens": 12, "repetition_penalty": 1.3,
                                                  "details": True}}
    r = server.post(body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 3
    for prompt, res in zip(PROMPTS[:3], out):
        assert [t["id"] for t in res["details"]["tokens"]] == \
            hf_greedy(demo_model_dir, prompt, 12, repetition_penalty=1.3)


def test_stop_sequence_and_return_full_text(server, demo_model_dir):
    prompt = PROMPTS[6]
    full = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 20}}).json()["generated_text"]
    assert len(full) > 6
    stop = full[3:6]                           # occurs in the output, ends it there
    r = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 20, "stop_sequences": [stop],
                                                      "details": True, "return_full_text": True}})
    res = r.json()
    cut = full[:full.index(stop) + len(stop)]
    assert res["generated_text"] == prompt + cut
    assert res["details"]["finish_reason"] == "stop_sequence"


def test_streaming_lines_arrive_incrementally(server, demo_model_dir):
    n = 40
    body = {"inputs": PROMPTS[0], "stream": True, "parameters": {"max_new_tokens": n, "ignore_eos": True,
                                                                 "details": True}}
    t0 = time.monotonic()
    arrivals, lines = [], []
    with requests.post(server.url + "/invocations", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/jsonlines")
        for raw in r.iter_lines():
            if raw:
                arrivals.append(time.monotonic() - t0)
                lines.append(json.loads(raw))
    assert len(lines) == n
    assert all("token" in ln for ln in lines)
    assert "generated_text" in lines[-1] and all("generated_text" not in ln for ln in lines[:-1])
    assert "".join(ln["token"]["text"] for ln in lines) == lines[-1]["generated_text"]
    assert lines[-1]["details"]["generated_tokens"] == n
    # The first line came well before the last: tokens are sent as they are produced.
    assert arrivals[0] < arrivals[-1] * 0.7, arrivals


def test_bad_requests_get_400_naming_the_field(server):
    cases = [
        (b"{not json", "body"),
        (json.dumps({"parameters": {}}).encode(), "inputs"),
        (json.dumps({"inputs": 3}).encode(), "inputs"),
        (json.dumps({"inputs": ""}).encode(), "inputs"),
        (json.dumps({"inputs": []}).encode(), "inputs"),
        (json.dumps({"inputs": ["ok", 5]}).encode(), "inputs[1]"),
        (json.dumps({"inputs": "x", "parameters": {"max_new_tokens": 0}}).encode(), "parameters.max_new_tokens"),
        # "5" is 5 as current LMI reads it (option.lmi_compat, tests/http/test_lmi_compat.py); "five" is no number
        (json.dumps({"inputs": "x", "parameters": {"max_new_tokens": "five"}}).encode(), "parameters.max_new_tokens"),
        (json.dumps({"inputs": "x", "parameters": {"top_p": 1.5}}).encode(), "parameters.top_p"),
        (json.dumps({"inputs": "x", "parameters": {"temperature": -1}}).encode(), "parameters.temperature"),
        (json.dumps({"inputs": "x", "parameters": {"top_k": -3}}).encode(), "parameters.top_k"),
        (json.dumps({"inputs": "x", "parameters": {"n": 17}}).encode(), "parameters.n"),
        (json.dumps({"inputs": "x", "parameters": {"repetition_penalty": 0}}).encode(), "parameters.repetition_penalty"),
        (json.dumps({"inputs": "x", "parameters": {"do_sample": "maybe"}}).encode(), "parameters.do_sample"),
        (json.dumps({"inputs": "x", "parameters": {"stop_sequences": [""]}}).encode(), "parameters.stop_sequences"),
        (json.dumps({"inputs": "x", "stream": "yes"}).encode(), "stream"),
        (json.dumps({"inputs": "word " * 2000}).encode(), "inputs"),
        (json.dumps({"inputs": "x", "parameters": {"max_new_tokens": 10**6}}).encode(), "parameters.max_new_tokens"),
    ]
    for body, field in cases:
        r = requests.post(server.url + "/invocations", data=body,
                          headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body[:60], r.status_code, r.text)
        err = r.json()
        assert err["field"] == field and err["error"], (body[:60], err)
    # still serving
    assert server.post({"inputs": "x", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_execution_parameters_and_metrics(server):
    r = requests.get(server.url + "/execution-parameters", timeout=5)
    assert r.status_code == 200 and r.json()["MaxConcurrentTransforms"] >= 1
    m = requests.get(server.url + "/metrics", timeout=5).text
    assert "\nlmi_kv_utilization{" in m and "\nlmi_generated_tokens_total{" in m


def test_best_of_samples_share_the_prompt_on_paged_as_metrics_show(server, demo_model_dir):
    def forked():
        text = requests.get(server.url + "/metrics", timeout=5).text
        return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                    if s.name == "lmi_forked_prompt_tokens_total")
    before = forked()
    r = server.post({"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 6, "best_of": 3, "details": True}})
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == hf_greedy(demo_model_dir, PROMPTS[2], 6)
    prompt_len = len(tokenizer(demo_model_dir)(PROMPTS[2])["input_ids"])
    assert forked() - before == (2 * (prompt_len - 1) if server.strategy == "paged" else 0)
