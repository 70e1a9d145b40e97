"""The gunicorn worker classes: gevent (the default) or gthread (LMI_HTTP_WORKER=gthread), each
with two behaviours gunicorn lacks.

- Errors gunicorn answers itself (a malformed request line, headers over the limits, a bad chunk
  size, ...) are rendered by `gunicorn.util.write_error` as an HTML page; these workers render
  them as the app's JSON error ({"code": ..., "error": ...}).
- On SIGTERM gunicorn's workers stop accepting but keep their listening sockets open for up to
  a second (gevent) or until they exit (gthread), so a new connection sits in the kernel's
  backlog and is then reset. These workers close them at once (the master closes its copies
  too): a new connection is refused immediately, and a load balancer moves on, while in-flight
  requests finish within `graceful_timeout`.

Slow clients (slowloris), gevent worker: every client socket is wrapped (`_Conn`) so that a
request's headers must arrive within `LIMITS.header_s` of their first byte and its body within
`LIMITS.body_s` of the headers, else the connection is dropped (a late body gets a 408 first); an
idle keep-alive connection waits `keepalive` (75 s). At `LIMITS.max_connections` open
connections a new one closes the oldest idle or still-sending one (never one whose request is being
answered), so trickling clients cannot lock a normal request out; gevent's pool is a little larger
than the limit so that the new connection is accepted to do so. The limits are serving.properties
keys (option.http_header_timeout, option.http_body_timeout, option.http_max_connections), set by
handler/server.py before the worker forks.

Why gevent: a streamed token costs an OS thread wake-up per token with gthread (one thread per
request, waiting on its channel); with gevent every request is a greenlet of the worker's main
thread, which the engine wakes once per step for all of its tokens (handler/http/hub.py). Nothing is
monkey-patched: the listening sockets are gevent's, so every client socket is, and the app's
waits are gevent events; the engine, the model load and the TP ranks keep real threads.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass

import gevent
from gunicorn import util
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker
from gunicorn.workers.gthread import ThreadWorker

from handler.http.guard import SlowBody

log = logging.getLogger("lmi.http")

LINGER_S = 2.0            # an error answered early: read what the client still sends, this long
LINGER_BYTES = 1 << 20


def _end(sock) -> None:
    """End a keep-alive connection: its reader (gunicorn's parser) sees the end of the stream."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _linger(sock) -> None:
    """Half-close and read the rest of the client's request before the socket is closed: closing
    it with unread bytes (a 9 KB request line refused at 4 KB) sends a reset, which can destroy
    the error answer before the client reads it. gthread is slow enough to hide this; gevent
    answers within the client's send."""
    try:
        sock.shutdown(socket.SHUT_WR)
        with gevent.Timeout(LINGER_S, False):
            left = LINGER_BYTES
            while left > 0:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                left -= len(chunk)
    except OSError:
        pass


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    mesg = mesg if len(mesg) <= 200 else mesg[:200] + "..."   # it may echo a huge request line
    body = json.dumps({"code": status_int, "error": f"{reason}: {mesg}" if mesg else reason}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
    util.write_nonblock(sock, head + body)


@dataclass(frozen=True)
class HttpLimits:
    header_s: float = 10.0          # option.http_header_timeout
    body_s: float = 60.0            # option.http_body_timeout
    max_connections: int = 1000     # option.http_max_connections

    @property
    def pool(self) -> int:
        """gevent's pool: room beyond the limit to accept the connection that evicts a slow one."""
        return self.max_connections + max(16, self.max_connections // 10)


LIMITS = HttpLimits()   # replaced by handler/server.py from the configuration


class _Conn:
    """A client socket whose reads are bounded by the request's phase: idle (keep-alive, no
    bound here: gunicorn's keepalive applies), headers (header_s from their first byte), body
    (body_s from the end of the headers), answering (no reads expected). Everything else is
    the socket's own."""

    def __init__(self, sock, addr, limits: HttpLimits):
        self._sock, self.addr, self.limits = sock, addr, limits
        self.phase = "idle"
        self.deadline: float | None = None
        self.since = time.monotonic()
        self.dropped: str | None = None

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def fileno(self):
        return self._sock.fileno()

    def begin_body(self) -> None:
        self.phase, self.since = "body", time.monotonic()
        self.deadline = self.since + self.limits.body_s

    def end_request(self) -> None:
        self.phase, self.deadline, self.since = "idle", None, time.monotonic()

    def answering(self) -> None:
        """The body is read (handler.http.guard.read_body says so through the environ's
        gunicorn.socket): no longer a slow sender, never evicted."""
        self.phase, self.deadline = "answering", None

    def drop(self, why: str) -> None:
        """Shut the socket down now: a read in progress returns b"", and the greenlet ends the
        connection."""
        if self.dropped is None:
            self.dropped = why
            log.info("closed the connection from %s: %s", self.addr[0] if self.addr else "?", why)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def recv(self, n: int, *args) -> bytes:
        if self.dropped is not None:
            return b""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(n, *args)
        except socket.timeout:
            data = None
        finally:
            self._sock.settimeout(None)
        if data is None:
            if self.phase == "body":
                self.dropped = f"the body did not arrive within option.http_body_timeout={self.limits.body_s:g} s"
                log.info("closed the connection from %s: %s", self.addr[0] if self.addr else "?", self.dropped)
                raise SlowBody(self.dropped)
            self.drop(f"the headers did not arrive within option.http_header_timeout={self.limits.header_s:g} s")
            return b""
        if self.phase == "idle" and data:          # a request begins: its headers are timed
            self.phase, self.since = "headers", time.monotonic()
            self.deadline = self.since + self.limits.header_s
        return data


class _JsonErrors:
    def init_process(self):
        # gunicorn's only renderer of its own errors; this process serves JSON everywhere.
        util.write_error = write_json_error
        super().init_process()


class Worker(_JsonErrors, ThreadWorker):
    def set_accept_enabled(self, enabled):
        super().set_accept_enabled(enabled)
        if not enabled and not self.alive:   # stopping: refuse new connections from now on
            for s in self.sockets:
                s.close()


class GeventWorker(_JsonErrors, _GeventWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._conns: dict = {}      # client socket -> busy with a request (False: idle keep-alive)
        self._servers: list = []    # gevent's StreamServers, made by run()

    def patch(self):
        # gunicorn's patch() is monkey.patch_all(): it would turn the engine's and the loader's
        # threads into greenlets of this one. Only the listening sockets become gevent's.
        from gevent import server
        from gevent import socket as gsocket
        from gunicorn.workers import ggevent
        self.sockets = [gsocket.socket(s.FAMILY, socket.SOCK_STREAM, fileno=s.sock.detach())
                        for s in self.sockets]
        servers = self._servers

        class Server(server.StreamServer):     # run() makes them; _refuse closes them
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                servers.append(self)

        ggevent.StreamServer = Server          # this worker process's module only

    def handle(self, listener, client, addr):
        conn = _Conn(client, addr, LIMITS)
        if len(self._conns) >= LIMITS.max_connections:
            self._evict()
        self._conns[conn] = False
        try:
            super().handle(listener, conn, addr)
        finally:
            self._conns.pop(conn, None)

    def _evict(self) -> None:
        """At the connection limit: close the idle keep-alive connection, else the one still
        sending its headers, else its body, that has waited longest; if every connection is
        being answered, the new one waits in gevent's pool headroom."""
        for phase in ("idle", "headers", "body"):
            slow = [c for c, busy in self._conns.items() if c.phase == phase and c.dropped is None
                    and (phase != "idle" or not busy)]
            if slow:
                victim = min(slow, key=lambda c: c.since)
                victim.drop(f"option.http_max_connections={LIMITS.max_connections} reached; "
                            f"this connection was {'idle' if phase == 'idle' else 'still sending its ' + phase} "
                            f"for {time.monotonic() - victim.since:.1f} s")
                return

    def handle_request(self, listener_name, req, sock, addr):
        self._conns[sock] = True
        if isinstance(sock, _Conn):
            sock.begin_body()
        try:
            super().handle_request(listener_name, req, sock, addr)
        finally:
            self._conns[sock] = False   # handle() holds it until the connection ends
            if isinstance(sock, _Conn):
                sock.end_request()
            if not self.alive:          # begun before SIGTERM: not kept alive either
                _end(sock)

    def handle_error(self, req, client, addr, exc):
        super().handle_error(req, client, addr, exc)   # the JSON error (write_json_error)
        _linger(client)

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        gevent.spawn(self._refuse)

    def _refuse(self):
        """Stop listening, and end idle keep-alive connections: gevent's worker would wait for
        each to time out (keepalive, 75 s) before exiting. A busy one is closed after its
        response."""
        for srv in self._servers:
            srv.close()
        for client, busy in list(self._conns.items()):
            if not busy:
                _end(client)
