"""The latency policies with the real model (no HTTP): greedy output still equals model.generate
when steps are sized to a target TPOT and when priority classes preempt (recompute) running ones."""
from __future__ import annotations

import pytest

from handler.engine.request import SamplingParams
from tests.support.engine import (NEW, PROMPTS, STRATEGIES, _drained, assert_drained, driven_by_hand,
                                  make_engine, run_all)
from tests.support.reference import hf_greedy


@pytest.mark.parametrize("strategy", ["rolling", "paged"])
def test_greedy_parity_under_a_target_tpot(strategy, demo_model_dir, tmp_path):
    # 1 ms: once the cost model has learnt the steps, the decode rows alone fill it, so prompts
    # are admitted only as running ones finish (or, with nothing decoding, by the floor) and are
    # chunked by the 16-token cap.
    props = {**STRATEGIES[strategy], "option.target_tpot_ms": "1", "option.scheduling_aging_ms": "20",
             "option.max_rolling_batch_prefill_tokens": "16"}
    engine = make_engine(demo_model_dir, tmp_path, props)
    try:
        prompts, news = PROMPTS * 2, NEW * 2
        results = run_all(engine, prompts, [SamplingParams(max_new_tokens=n) for n in news])
        for p, n, (ids, _) in zip(prompts, news, results):
            assert ids == hf_greedy(demo_model_dir, p, n), (strategy, p[:20])
        assert engine.scheduler.cost.coef is not None      # it measured its steps
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_greedy_parity_when_a_higher_priority_preempts(demo_model_dir, tmp_path):
    props = {**STRATEGIES["paged"], "option.scheduling_policy": "priority", "option.max_rolling_batch_size": "2"}
    engine = driven_by_hand(make_engine(demo_model_dir, tmp_path, props))
    try:
        low = [engine.submit([engine.tokenize(p)], SamplingParams(max_new_tokens=24, priority=5))[0]
               for p in PROMPTS[:2]]
        for _ in range(4):
            engine.step()
        high = engine.submit([engine.tokenize(PROMPTS[2])], SamplingParams(max_new_tokens=6, priority=-1))[0]
        while engine.scheduler.has_work or engine._intake:
            engine.step()
        assert engine.scheduler.preemption_causes["priority"] == 1
        for ch, p, n in ((low[0], PROMPTS[0], 24), (low[1], PROMPTS[1], 24), (high, PROMPTS[2], 6)):
            evs = _drained(ch.events)
            assert [e.id for e in evs] == hf_greedy(demo_model_dir, p, n)
            assert evs[-1].done is not None
        assert engine.stats()["preemptions_by_cause"] == {"kv_cache": 0, "priority": 1}
        assert_drained(engine)
    finally:
        engine.shutdown()
