"""The gunicorn worker class: gthread, plus two behaviours gunicorn lacks.

- Errors gunicorn answers itself (a malformed request line, headers over the limits, a bad chunk
  size, ...) are rendered by `gunicorn.util.write_error` as an HTML page; this worker renders
  them as the app's JSON error ({"code": ..., "error": ...}).
- On SIGTERM gthread stops polling its listening sockets but keeps them open until it exits, so
  a new connection sits in the kernel's backlog for the whole drain and is then reset. This
  worker closes them at once (the master closes its copies too): a new connection is refused
  immediately, and a load balancer moves on, while in-flight requests finish within
  `graceful_timeout`.
"""
from __future__ import annotations

import json

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    mesg = mesg if len(mesg) <= 200 else mesg[:200] + "..."   # it may echo a huge request line
    body = json.dumps({"code": status_int, "error": f"{reason}: {mesg}" if mesg else reason}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
    util.write_nonblock(sock, head + body)


class Worker(ThreadWorker):
    def init_process(self):
        # gunicorn's only renderer of its own errors; this process serves JSON everywhere.
        util.write_error = write_json_error
        super().init_process()

    def set_accept_enabled(self, enabled):
        super().set_accept_enabled(enabled)
        if not enabled and not self.alive:   # stopping: refuse new connections from now on
            for s in self.sockets:
                s.close()
