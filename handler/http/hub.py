"""The gevent front end's side of the engine's channels (handler/http/worker.py's GeventWorker).

Requests are greenlets of the worker's main thread (the hub's); the engine is a real thread.
The engine's output processor (handler/engine/output.py) makes each channel's wake-up with
`event()` when the request submits (in the request's greenlet), and calls the waker once per
step with the channels it delivered to; the hub then sets each one's gevent event, so one
cross-thread wake-up per step serves every streaming request, where a thread per request costs
one per token.
"""
from __future__ import annotations

import gevent.event
from gevent import get_hub


class HubWaker:
    """Made in the hub's thread (the app's state is built there)."""

    def __init__(self):
        self.loop = get_hub().loop

    def event(self):
        """A channel's wake-up: its reader waits on it (handler.http.protocols.events) instead of
        the queue. Called in the hub's thread (the submitting greenlet)."""
        return gevent.event.Event()

    def __call__(self, chans) -> None:
        """Output thread: wake these channels' readers (in the hub, once for all of them)."""
        self.loop.run_callback_threadsafe(_set, chans)


def _set(chans) -> None:
    for ch in chans:
        wake = ch.wake
        if wake is not None:
            wake.set()
