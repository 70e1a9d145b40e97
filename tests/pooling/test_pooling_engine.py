"""The pooling engine (handler/engine/pooling.py) on a fake runner: batches by token budget, size and
max_batch_delay; results in input order across batches; long inputs, a full queue and a failing forward."""
from __future__ import annotations

import threading
import time

import pytest

from handler.engine.admission import CapacityError, QueueFull
from handler.engine.pooling import PoolInput, PoolingEngine, PoolingPolicy


class FakeRunner:
    tokenizer = None
    max_model_len = 16
    task = "text_embedding"

    def __init__(self, fail=False, hold=None):
        self.batches, self.fail, self.hold = [], fail, hold

    def pool(self, inputs, kind):
        if self.hold is not None:
            self.hold.wait(5)
        self.batches.append([len(x.ids) for x in inputs])
        if self.fail:
            raise RuntimeError("boom")
        return [[float(sum(x.ids)), float(len(x.ids))] for x in inputs]


def engine(runner, tokens=10, size=4, delay=0.0, waiting=100):
    return PoolingEngine(runner, PoolingPolicy(tokens, size, delay, waiting)).start()


def test_results_in_order_across_token_budget_batches():
    r = FakeRunner()
    eng = engine(r, tokens=10, size=4, delay=0.05)
    try:
        job = eng.submit([PoolInput([i] * n) for i, n in enumerate([4, 4, 4, 9, 1, 16])], "embed")
        assert job.wait(5)
        assert job.results == [[0.0, 4.0], [4.0, 4.0], [8.0, 4.0], [27.0, 9.0], [4.0, 1.0], [80.0, 16.0]]
        assert job.prompt_tokens == 38 and job.error is None
        # token budget 10: [4, 4] | [4] (9 would pass it) | [9, 1] | [16] (alone over the budget)
        assert r.batches == [[4, 4], [4], [9, 1], [16]]
    finally:
        eng.shutdown()


def test_max_batch_delay_gathers_requests_into_one_forward():
    r = FakeRunner()
    eng = engine(r, tokens=100, size=8, delay=0.3)
    try:
        jobs = [eng.submit([PoolInput([1, 2])], "embed")]
        time.sleep(0.05)
        jobs.append(eng.submit([PoolInput([3])], "embed"))
        assert all(j.wait(5) for j in jobs)
        assert r.batches == [[2, 1]]
    finally:
        eng.shutdown()


def test_too_long_input_and_full_queue_are_refused():
    hold = threading.Event()
    r = FakeRunner(hold=hold)
    eng = engine(r, size=1, waiting=2)
    try:
        with pytest.raises(CapacityError, match="17 tokens; this model takes at most 16"):
            eng.submit([PoolInput([1] * 17)], "embed")
        first = eng.submit([PoolInput([1])], "embed")
        time.sleep(0.1)     # the engine holds `first` inside its forward
        eng.submit([PoolInput([1]), PoolInput([2])], "embed")
        with pytest.raises(QueueFull, match="job_queue_size=2"):
            eng.submit([PoolInput([1])], "embed")
        assert eng.stats()["rejected_queue_full"] == 1
        hold.set()
        assert first.wait(5)
    finally:
        hold.set()
        eng.shutdown()


def test_a_failing_forward_fails_its_requests_and_the_engine_goes_on():
    r = FakeRunner(fail=True)
    eng = engine(r)
    try:
        job = eng.submit([PoolInput([1, 2])], "embed")
        assert job.wait(5) and job.error == "the model failed: RuntimeError: boom"
        r.fail = False
        ok = eng.submit([PoolInput([5])], "embed")
        assert ok.wait(5) and ok.results == [[5.0, 1.0]]
        assert eng.check_health()
    finally:
        eng.shutdown()
