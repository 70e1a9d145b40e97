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

Why gevent: a streamed token costs an OS thread wake-up per token with gthread (one thread per
request, waiting on its channel); with gevent every request is a greenlet of the worker's main
thread, which the engine wakes once per step for all of its tokens (handler/http/hub.py). Nothing is
monkey-patched: the listening sockets are gevent's, so every client socket is, and the app's
waits are gevent events; the engine, the model load and the TP ranks keep real threads.
"""
from __future__ import annotations

import json
import socket

import gevent
from gunicorn import util
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker
from gunicorn.workers.gthread import ThreadWorker

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
        self._conns[client] = False
        try:
            super().handle(listener, client, addr)
        finally:
            self._conns.pop(client, None)

    def handle_request(self, listener_name, req, sock, addr):
        self._conns[sock] = True
        try:
            super().handle_request(listener_name, req, sock, addr)
        finally:
            self._conns[sock] = False   # handle() holds it until the connection ends
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
