"""Operating the real server: queue limits, time-outs, disconnects, SSE, start-up errors, SIGTERM."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import ROOT, Server

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 900, "ignore_eos": True}


def metric(srv, name, **labels) -> float:
    """A sample of /metrics (parsed by prometheus_client), summed over the labels not given."""
    text = requests.get(srv.url + "/metrics", timeout=5).text
    found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == name and labels.items() <= s.labels.items()]
    if not found and name != "lmi_requests_total":     # an outcome not seen yet counts 0
        raise AssertionError(f"{name} not in /metrics")
    return sum(found)


def wait_for(pred, timeout=60.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_queue_full_503_then_recovers(demo_model_dir, tmp_path):
    srv = Server("option.rolling_batch=scheduler\noption.max_rolling_batch_size=1\njob_queue_size=2\n",
                 demo_model_dir, tmp_path)
    try:
        results = []
        busy = requests.post(srv.url + "/invocations", json={"inputs": "a", "stream": True,
                                                            "parameters": LONG}, stream=True, timeout=120)
        busy_lines = busy.iter_lines()                   # keep a reference: dropping the
        next(busy_lines)                                 # iterator may close the stream
        # it is running
        waiters = [threading.Thread(target=lambda: results.append(
            srv.post({"inputs": "b", "parameters": {"max_new_tokens": 2}}).status_code)) for _ in range(2)]
        for t in waiters:
            t.start()
        assert wait_for(lambda: metric(srv, "lmi_waiting") == 2), requests.get(srv.url + "/metrics").text
        t0 = time.time()
        r = srv.post({"inputs": "c", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 503 and time.time() - t0 < 2.0
        assert "job_queue_size" in r.json()["error"]
        assert metric(srv, "lmi_requests_total", outcome="queue_full", code="503") == 1
        assert metric(srv, "lmi_rejected_queue_full_total") == 1
        busy.close()                                     # frees the running slot
        for t in waiters:
            t.join(60)
        assert results == [200, 200]                     # nothing accepted was lost
        assert srv.post({"inputs": "d", "parameters": {"max_new_tokens": 2}}).status_code == 200
    finally:
        srv.stop()


def timed(srv, tokens: int) -> float:
    """Seconds one request of `tokens` generated tokens takes on this host (one at a time)."""
    t0 = time.time()
    r = srv.post({"inputs": "a", "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}, timeout=600)
    assert r.status_code == 200, r.text
    return time.time() - t0


def test_request_timeout_gives_504_and_frees_the_sequence(demo_model_dir, tmp_path):
    # The deadline from what this host measures (a fixed one fails one way on a fast host, where 900
    # tokens finish first, and the other on a slow one, where a 3-token request misses it): a short
    # request and the long one timed on a first server, the second
    # server's deadline their geometric mean, so the long one outlives it and the short one fits,
    # with a factor of 5 either side.
    probe = Server("engine=Python\n", demo_model_dir, tmp_path)
    try:
        timed(probe, 3)                                  # the first request's one-off costs
        short = max(timed(probe, 3) for _ in range(3))
        long = timed(probe, LONG["max_new_tokens"])    # measured whole: 100 tokens scaled up overestimate it
    finally:
        probe.stop()
    if long < 25 * short:
        pytest.skip(f"this host takes {short:.3f} s for 3 tokens and {long:.3f} s for 900: too close to put a "
                    "deadline between them")
    deadline = (short * long) ** 0.5
    srv = Server("engine=Python\n", demo_model_dir, tmp_path,
                 env={"SAGEMAKER_MODEL_SERVER_TIMEOUT": f"{deadline:.3f}"})
    try:
        t0 = time.time()
        r = srv.post({"inputs": "a", "parameters": LONG})
        took = time.time() - t0
        assert r.status_code == 504 and 0.8 * deadline < took < deadline + 10, (r.status_code, took, deadline)
        assert "timed out" in r.json()["error"]
        assert wait_for(lambda: metric(srv, "lmi_running") == 0 and metric(srv, "lmi_kv_tokens_allocated") == 0)
        assert metric(srv, "lmi_requests_total", outcome="timeout", code="504") == 1
        assert srv.post({"inputs": "b", "parameters": {"max_new_tokens": 3}}).status_code == 200
    finally:
        srv.stop()


def test_disconnect_mid_stream_frees_the_sequence_and_sse_format(demo_model_dir, tmp_path):
    srv = Server("option.rolling_batch=auto\noption.output_formatter=sse\n", demo_model_dir, tmp_path)
    try:
        r = requests.post(srv.url + "/invocations", json={"inputs": "x", "parameters": LONG},
                          stream=True, timeout=120)
        assert r.headers["content-type"].startswith("text/event-stream")
        first = next(ln for ln in r.iter_lines() if ln)
        assert first.startswith(b"data: ") and "token" in json.loads(first[6:])
        r.close()
        assert wait_for(lambda: metric(srv, "lmi_running") == 0)
        assert metric(srv, "lmi_aborted_total") >= 1
        assert wait_for(lambda: metric(srv, "lmi_requests_total", outcome="aborted", code="499") == 1)
        assert metric(srv, "lmi_generated_tokens_total") < 900
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_requests(demo_model_dir, tmp_path):
    srv = Server("option.rolling_batch=auto\n", demo_model_dir, tmp_path)
    # A request of about 3 s on this host (its decode speed measured first; 64 to 900 tokens): seen
    # running before SIGTERM on a fast host, finished within the join on a slow one.
    timed(srv, 8)
    per_token = timed(srv, 64) / 64
    n = int(min(900, max(64, 3.0 / per_token)))
    expect = n * per_token
    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "r", srv.post({"inputs": "y", "parameters": {"max_new_tokens": n, "ignore_eos": True}},
                      timeout=120 + 20 * expect)))
    t.start()
    assert wait_for(lambda: metric(srv, "lmi_running") == 1 or "r" in box)
    assert "r" not in box, f"{n} tokens finished before the request was seen running ({expect:.2f} s expected)"
    srv.proc.send_signal(signal.SIGTERM)
    t.join(120 + 20 * expect)
    assert "r" in box, f"the in-flight request of {n} tokens ({expect:.2f} s expected) did not finish"
    assert box["r"].status_code == 200
    assert len(box["r"].json()["generated_text"]) > 0
    # Drained, the server exits by itself, 0. (Not srv.stop(): its own SIGTERM could land while the
    # interpreter is finalizing, signal handlers back at their defaults, and read as a crash: -15.)
    assert srv.proc.wait(60) == 0
    srv.stop()


def serve(args, **kw):
    return subprocess.run([sys.executable, "-m", "handler", "serve", "--port", "1", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("props,needle", [
    ("option.rolling_batch=trtllm\n", "option.rolling_batch"),
    ("batch_size=8\noption.output_formatter=jsonlines\n", "dynamic"),
    ("option.max_rolling_batch_size=0\n", "option.max_rolling_batch_size"),
    ("option.dtype=fp8\n", "option.dtype"),
])
def test_bad_configuration_exits_with_one_clear_line(props, needle, demo_model_dir, tmp_path):
    p = tmp_path / "serving.properties"
    p.write_text(props)
    res = serve(["--properties", str(p), "--model-dir", demo_model_dir])
    assert res.returncode != 0
    assert "Traceback" not in res.stderr + res.stdout
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr


def test_missing_or_corrupt_model_exits_clearly(demo_model_dir, tmp_path):
    res = serve(["--model-dir", str(tmp_path / "nope")])
    assert res.returncode != 0 and "Traceback" not in res.stderr and "nope" in res.stderr
    bad = tmp_path / "bad"
    shutil.copytree(demo_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    res = serve(["--model-dir", str(bad)])
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "model.safetensors" in res.stderr
