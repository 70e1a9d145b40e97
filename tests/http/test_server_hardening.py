"""Hostile input, shutdown and overload against the real server (gunicorn + the app + the tiny
model). Volume fuzzing is in test_hardening.py (Flask's client); here a smaller fuzz."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.server import Server, assert_eventually, flat_metrics
from tests.support.hostile import _body, _bounded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(demo_model_dir, tmp_path_factory):
    s = Server("option.rolling_batch=auto\noption.max_rolling_batch_size=8\n", demo_model_dir,
               tmp_path_factory.mktemp("hardening"))
    yield s
    assert s.stop() == 0


def raw(srv, data: bytes, timeout=10.0) -> tuple[int, dict | str]:
    """Send bytes on a fresh connection; (status, JSON body or the raw text)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("latin-1")


def metrics(srv) -> dict:
    return flat_metrics(requests.get(srv.url + "/metrics", timeout=10).text)


def worker_rss_mb(srv) -> float:
    pid = srv.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        worker = int(f.read().split()[0])
    with open(f"/proc/{worker}/status") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    return kb / 1024


@pytest.mark.parametrize("data,status", [
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n", 431),
    (b"GET /ping HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
    (b"NOT A REQUEST LINE\r\n\r\n", 400),
    (b"POST /invocations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
     b"Content-Type: application/json\r\n\r\nZZZ\r\n{}\r\n0\r\n\r\n", 400),
], ids=["uri-too-long", "header-too-large", "too-many-headers", "bad-request-line", "bad-chunk-size"])
def test_framework_errors_are_our_json(srv, data, status):
    got, body = raw(srv, data)
    assert got == status, body
    assert isinstance(body, dict) and body["code"] == status and body["error"], body


def test_declared_50mb_body_is_413_at_once_and_memory_stays_flat(srv):
    before = worker_rss_mb(srv)
    t0 = time.time()
    status, body = raw(srv, b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 50000000\r\n\r\n{\"inputs\": \"")
    assert status == 413 and "6000000" in body["error"] and time.time() - t0 < 5
    # A 50 MB body actually sent (chunked, no length declared): cut at 6 MB, memory flat.
    r = requests.post(srv.url + "/invocations", data=(b"x" * (1 << 20) for _ in range(50)),
                      headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 413 and r.json()["code"] == 413
    assert worker_rss_mb(srv) - before < 40, (before, worker_rss_mb(srv))
    assert srv.post({"inputs": "still fine", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_upload_disconnect_is_counted_apart_from_server_errors(srv):
    before = metrics(srv)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"inputs\": \"hel")
    assert_eventually(lambda: metrics(srv)["lmi_http_client_disconnects_total"]
                      == before["lmi_http_client_disconnects_total"] + 1)
    assert metrics(srv)['lmi_http_responses_total{class="other"}'] == before['lmi_http_responses_total{class="other"}']


def test_fuzz_against_the_real_server_harms_no_batch_mate(srv):
    mate = {"inputs": "def batch_mate(x):", "parameters": {"max_new_tokens": 60, "ignore_eos": True}}
    alone = srv.post(mate).json()
    answers, stop = [], threading.Event()

    def run_mate():
        while not stop.is_set():
            r = srv.post(mate)
            answers.append((r.status_code, r.json()))

    t = threading.Thread(target=run_mate)
    t.start()
    session = requests.Session()
    try:
        @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(_body.map(_bounded))
        def case(body):
            r = session.post(srv.url + "/invocations", data=json.dumps(body), timeout=60,
                             headers={"Content-Type": "application/json"})
            assert r.status_code < 500, r.text[:500]
            if r.status_code >= 400:
                assert r.json()["code"] == r.status_code and r.json()["error"]
            else:
                for line in r.text.splitlines():
                    json.loads(line)

        case()
    finally:
        stop.set()
        t.join(120)
    assert answers and all(a == (200, alone) for a in answers), answers[:3]
    assert requests.get(srv.url + "/ping", timeout=10).status_code == 200
    assert_eventually(lambda: metrics(srv)["lmi_kv_tokens_allocated"] == 0)


def test_sigterm_refuses_new_connections_at_once_and_drains(demo_model_dir, tmp_path):
    s = Server("option.rolling_batch=auto\n", demo_model_dir, tmp_path, env={"SERVING_GRACEFUL_TIMEOUT": "120"})
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", s.post(
        {"inputs": "y", "parameters": {"max_new_tokens": 80, "ignore_eos": True}})))
    t.start()
    assert_eventually(lambda: metrics(s)["lmi_running"] == 1)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.time()
    with pytest.raises(requests.ConnectionError):
        requests.post(s.url + "/invocations", json={"inputs": "new"}, timeout=5)
    assert time.time() - t0 < 4.0                        # refused, not left hanging
    t.join(120)
    assert box["r"].status_code == 200 and box["r"].json()["generated_text"]
    # Drained, the server exits by itself, 0. (Not s.stop(): its own SIGTERM could land while the
    # interpreter is finalizing, signal handlers back at their defaults, and read as a crash: -15.)
    assert s.proc.wait(60) == 0
    s.stop()
