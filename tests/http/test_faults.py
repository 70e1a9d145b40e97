"""Engine faults behind the real app (the fake runner, Flask's client): an exception in
a model step fails that step's requests only; an engine thread that dies or a step that wedges
past option.engine_step_timeout turns /ping to 503 with the reason (in the log and the body)."""
from __future__ import annotations

import logging
import threading

import pytest

from tests.http.test_hardening import assert_json_error, served, wait_for  # noqa: F401 (fixture)

BODY = {"inputs": "a fault", "parameters": {"max_new_tokens": 4}}


class Died(BaseException):
    """Escapes every `except Exception`: what kills a thread (as a MemoryError in a bad place)."""


def test_an_exception_in_a_step_fails_that_step_and_the_server_stays_healthy(served):
    state, client = served()
    runner = state.engine.runner
    real = runner.step

    def broken(items, copies=()):
        runner.step = real            # only this step fails
        raise RuntimeError("CUDA error: an illegal memory access")

    runner.step = broken
    body = assert_json_error(client.post("/invocations", json=BODY), 424)
    assert "illegal memory access" in body["error"]
    assert client.get("/ping").status_code == 200
    assert client.post("/invocations", json=BODY).status_code == 200


def test_a_wedged_step_turns_ping_to_503_with_the_reason(served, caplog):
    state, client = served()
    runner = state.engine.runner
    state.engine.step_timeout_s = 0.5
    runner.hold.clear()                      # the next step never returns (until released)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", client.post("/invocations", json=BODY)))
    caplog.set_level(logging.ERROR, "lmi.engine")
    t.start()
    assert runner.in_step.wait(10)
    assert client.get("/ping").status_code == 200          # within the bound: healthy
    assert wait_for(lambda: client.get("/ping").status_code == 503, 10)
    ping = client.get("/ping").get_json()
    assert ping["status"] == "unhealthy" and "engine_step_timeout=0.5" in ping["error"]
    assert any("engine_step_timeout" in r.getMessage() for r in caplog.records)
    r = client.post("/invocations", json=BODY)    # refused at once, not left to time out
    assert r.status_code == 503 and "unhealthy" in r.get_json()["error"]
    runner.hold.set()                        # the step ends after all: the device is not trusted again
    t.join(30)
    assert box["r"].status_code == 200
    assert client.get("/ping").status_code == 503


def test_an_engine_thread_that_dies_answers_its_requests_and_turns_ping_to_503(served, caplog):
    state, client = served()

    def die(items, copies=()):
        raise Died("the engine thread is gone")

    state.engine.runner.step = die
    caplog.set_level(logging.ERROR, "lmi.engine")
    r = client.post("/invocations", json=BODY)
    body = assert_json_error(r, 503)
    assert "the engine stopped" in body["error"] and "Died" in body["error"]
    assert wait_for(lambda: not state.engine._thread.is_alive(), 10)
    ping = client.get("/ping")
    assert ping.status_code == 503
    assert "the engine thread has died" in ping.get_json()["error"]
    assert any("engine thread" in r.getMessage() for r in caplog.records)
    r = client.post("/invocations", json=BODY)    # nothing would answer it: refused at once
    assert r.status_code == 503 and "the engine thread has died" in r.get_json()["error"]


@pytest.mark.parametrize("fault", ["wedge", "die"])
def test_the_watchdog_logs_without_anyone_pinging(served, caplog, fault):
    """The watchdog thread notices by itself (logged once), so the reason is in the log even
    before SageMaker's next /ping."""
    state, client = served()
    engine = state.engine
    caplog.set_level(logging.ERROR, "lmi.engine")
    engine.step_timeout_s = 0.2
    if fault == "wedge":
        engine.runner.hold.clear()
    else:
        engine.runner.step = lambda items, copies=(): (_ for _ in ()).throw(Died("gone"))
    threading.Thread(target=client.post, args=("/invocations",), kwargs={"json": BODY}, daemon=True).start()
    assert wait_for(lambda: not engine.healthy, 10)       # set by the watchdog, not by a /ping
    assert sum("/ping answers 503" in r.getMessage() for r in caplog.records) == 1
    engine.runner.hold.set()
