"""The gevent front end (handler/http/hub.py, handler/http/worker.py): the engine's output processor
wakes the hub once per iteration for every channel it delivered to; readers are greenlets waiting on
gevent events."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import gevent
import pytest
import requests

from handler.http import protocols as api
from handler.config import ConfigError
from handler.engine.loop import Channel, ErrorEvent, TokenEvent
from handler.http.hub import HubWaker
from handler.engine.request import SamplingParams
from handler.server import http_worker
from tests.support.server import Server, assert_eventually, flat_metrics
from tests.support.engine import PROMPTS, driven_by_hand, make_engine


class _Waker:
    """Records each wake-up call (the processor's, once per batch) with its channels."""

    def __init__(self):
        self.calls = []

    def event(self):
        return None

    def __call__(self, chans):
        self.calls.append(list(chans))


def test_the_waker_is_called_once_per_iteration_with_the_channels_that_got_events(
        demo_model_dir, tmp_path):
    from handler.engine.loop import Engine
    built = make_engine(demo_model_dir, tmp_path, {"option.rolling_batch": "auto",
                                                   "option.paged_attention": "true"})
    built.run_by_hand()     # its threads stopped: a second engine drives the same runner
    waker = _Waker()
    engine = driven_by_hand(Engine(built.runner, built.scheduler.policy, built.blocks.block_size,
                                   waker=waker))
    calls = waker.calls
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    a, b = (engine.submit([engine.tokenize(p)], params)[0] for p in PROMPTS[:2])
    whole = engine.submit([engine.tokenize(PROMPTS[2])], params, stream=False)[0]
    iterations = 0
    while engine.scheduler.has_work or engine._intake:
        before = len(calls)
        engine.step()     # run by hand: its outputs are processed before it returns
        iterations += 1
        assert len(calls) - before <= 1
    streamed = [c for c in calls if a in c]
    assert len(streamed) == params.max_new_tokens          # one call per token step of `a`
    assert all(c.count(a) == 1 and c.count(b) == 1 for c in streamed)
    # The whole-answer channel is named once: when its held tokens and the last arrive together.
    assert sum(c.count(whole) for c in calls) == 1
    assert whole.events.qsize() == params.max_new_tokens

    # Failures reach the readers too (reset answers everyone with an ErrorEvent).
    c = engine.submit([engine.tokenize(PROMPTS[0])], params)[0]
    engine.step()
    calls.clear()
    engine.reset(ErrorEvent(500, "boom"))
    assert calls == [[c]]


class _Engine:
    def __init__(self):
        self.aborted = []

    def abort(self, sid):
        self.aborted.append(sid)


def _chan(sid=1, waker=None):
    return Channel(sid, [1, 2], SamplingParams(max_new_tokens=4),
                   wake=waker.event() if waker is not None else None)


def test_greenlet_readers_get_every_event_in_order_from_an_engine_thread():
    """A real thread puts events and wakes the hub once per 'step' for all channels; each
    greenlet reads its channel's events in order, and the hub stays free meanwhile."""
    waker = HubWaker()
    chans = [_chan(i, waker) for i in range(1, 9)]
    steps = 20
    got = {ch.seq_id: [] for ch in chans}

    def read(ch):
        for ev in api.events(_Engine(), ch, time.monotonic() + 30):
            got[ch.seq_id].append(ev.id)

    def engine_thread():
        for step in range(steps):
            last = step == steps - 1
            for ch in chans:
                ch.deliver(TokenEvent(step, "x", -1.0, done=object() if last else None), last=last)
            waker(chans)
            time.sleep(0.001)

    def tick():
        for _ in range(5):
            gevent.sleep(0.002)
        return time.monotonic()

    readers = [gevent.spawn(read, ch) for ch in chans]
    ticker = gevent.spawn(tick)
    t = threading.Thread(target=engine_thread)
    t.start()
    gevent.joinall(readers + [ticker], timeout=30, raise_error=True)
    readers_done = time.monotonic()
    t.join()
    assert all(got[ch.seq_id] == list(range(steps)) for ch in chans)
    # The readers' waits yield to the hub: another greenlet ran to its end while they waited
    # for the engine's 20 steps (a wait blocking the thread would hold it until they finished).
    assert ticker.value < readers_done - 0.005


def test_greenlet_reader_times_out_and_aborts():
    waker = HubWaker()
    ch = _chan(7, waker)
    eng = _Engine()
    t0 = time.monotonic()
    with pytest.raises(api.Timeout):
        gevent.spawn(lambda: list(api.events(eng, ch, time.monotonic() + 0.2))).get(timeout=10)
    assert 0.15 < time.monotonic() - t0 < 5
    assert eng.aborted == [7]


def test_a_wake_up_before_the_reader_waits_is_not_lost():
    """The processor may deliver and wake before the reader starts reading, or between the
    reader's empty read and its wait: the reader still gets the event."""
    waker = HubWaker()
    ch = _chan(3, waker)
    ch.deliver(TokenEvent(1, "a", -1.0), last=False)
    waker([ch])                     # no reader waiting yet
    gevent.sleep(0)
    ch.deliver(TokenEvent(2, "b", -1.0, done=object()), last=True)
    out = gevent.spawn(lambda: [e.id for e in api.events(_Engine(), ch, time.monotonic() + 5)]).get(timeout=10)
    assert out == [1, 2]


def test_http_worker_setting():
    assert http_worker({}) == "gevent"
    assert http_worker({"LMI_HTTP_WORKER": " GThread "}) == "gthread"
    with pytest.raises(ConfigError, match=r"LMI_HTTP_WORKER: 'uvicorn' is not one of gevent, gthread"):
        http_worker({"LMI_HTTP_WORKER": "uvicorn"})


@pytest.mark.parametrize("worker", ["gevent", "gthread"])
def test_both_workers_stream_and_answer_concurrent_requests(worker, demo_model_dir, tmp_path):
    props = ("option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=8\n"
             "option.kv_cache_tokens=1024\n")
    srv = Server(props, demo_model_dir, tmp_path, env={"LMI_HTTP_WORKER": worker})
    try:
        assert f"http={worker}" in srv.output()
        body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
        whole = srv.post(body).json()["generated_text"]
        results = [None] * 6

        def stream(i):
            r = srv.post({**body, "stream": True}, stream=True)
            lines = [ln for ln in r.iter_lines() if ln]
            results[i] = (r.status_code, len(lines), r.headers["content-type"], lines[-1])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for status, n, ctype, last in results:
            assert status == 200 and n == 6 and ctype.startswith("application/jsonlines")
            assert json.loads(last)["generated_text"] == whole
        # Every request recorded as answered (a cooperative read of an empty queue is not a
        # time-out), each with its 6 tokens. A stream is recorded when its response closes,
        # which may come just after the client has read its last line.
        ok = 'lmi_requests_total{code="200",outcome="ok"}'

        def scrape():
            return flat_metrics(requests.get(srv.url + "/metrics", timeout=10).text)
        assert_eventually(lambda: scrape().get(ok, 0) >= 7, timeout=10)
        m = scrape()
        assert m[ok] == 7
        assert not any(k.startswith("lmi_requests_total") and 'outcome="ok"' not in k and v
                       for k, v in m.items())
        assert m["lmi_request_generation_tokens_sum"] == 7 * 6
    finally:
        assert srv.stop() == 0


def test_bad_worker_setting_stops_the_server_with_the_reason(demo_model_dir, tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("option.rolling_batch=auto\n")
    r = subprocess.run([sys.executable, "-m", "handler", "serve", "--properties", str(props),
                        "--model-dir", demo_model_dir, "--port", "1"],
                       env={**os.environ, "LMI_HTTP_WORKER": "uvicorn"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "LMI_HTTP_WORKER: 'uvicorn' is not one of gevent, gthread" in r.stderr
