"""Slow clients against the real server (gunicorn's gevent worker): headers or bodies
trickled past option.http_header_timeout / option.http_body_timeout are dropped, an idle keep-alive
connection is not, and at option.http_max_connections a new connection evicts the oldest slow one
so a normal request is answered at once."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

from tests.support.server import Server

pytestmark = pytest.mark.slow

HEADER_S, BODY_S, MAX_CONN = 2.0, 3.0, 20


@pytest.fixture(scope="module")
def srv(demo_model_dir, tmp_path_factory):
    s = Server(f"option.rolling_batch=auto\noption.http_header_timeout={HEADER_S}\n"
               f"option.http_body_timeout={BODY_S}\noption.http_max_connections={MAX_CONN}\n",
               demo_model_dir, tmp_path_factory.mktemp("slow"))
    yield s
    assert s.stop() == 0


def closed_after(sock: socket.socket, trickle: bytes, limit: float) -> tuple[float, bytes]:
    """Send `trickle` a byte every 0.2 s until the server closes; (seconds, what it answered)."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    got, i = b"", 0
    while time.monotonic() - t0 < limit:
        try:
            chunk = sock.recv(65536)
            if not chunk:
                return time.monotonic() - t0, got
            got += chunk
        except socket.timeout:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0, got
        try:
            sock.send(trickle[i % len(trickle):i % len(trickle) + 1])
            i += 1
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - t0, got
    raise AssertionError(f"still open after {limit} s")


def test_trickled_headers_are_dropped_after_the_header_timeout(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        took, got = closed_after(s, b"GET /ping HTTP/1.1\r\nX-Slow: " + b"a" * 1000, 15)
    assert HEADER_S - 0.5 < took < HEADER_S + 3 and got == b""
    assert "option.http_header_timeout=2 s" in srv.output()


def test_a_trickled_body_gets_408_after_the_body_timeout(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n")
        took, got = closed_after(s, b'{"inputs": "' + b"a" * 1000, 20)
    assert BODY_S - 0.5 < took < BODY_S + 4
    assert got.startswith(b"HTTP/1.1 408") and b"option.http_body_timeout=3 s" in got


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        time.sleep(HEADER_S + 1)
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_slow_clients_at_the_connection_limit_do_not_lock_out_a_normal_request(srv):
    """Twice the limit of clients trickling headers: each new one evicts the oldest, and a
    normal request (a new connection) is answered well before any header timeout frees a slot."""
    socks, stop = [], threading.Event()
    try:
        for _ in range(2 * MAX_CONN):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /ping HTTP/1.1\r\n")
            socks.append(s)
        t0 = time.monotonic()
        r = requests.post(srv.url + "/invocations", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}},
                          timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 200 and took < HEADER_S, took
        assert "option.http_max_connections=20 reached" in srv.output()
    finally:
        stop.set()
        for s in socks:
            s.close()
