"""Speculative decoding configured but off (option.speculative_config with disable_by_batch_size, and at
least that many sequences running) costs nothing structural: the same configuration but for the key,
the same KV capacity, the same layer path, every step the same plan handed to the runner in the same
way, the same tokens out, and the proposer never asked. Below the threshold it does speculate (so that
these comparisons can tell the two apart)."""
from __future__ import annotations

import dataclasses

import pytest

from handler.engine.loop import ErrorEvent
from handler.engine.request import SamplingParams
from handler.engine.spec import PerSequence, drafts_of
from tests.support.engine import PROMPTS, STRATEGIES, make_engine

# Room for every prompt at once (no preemption): all are admitted on the first step.
PAGED = {**STRATEGIES["paged"], "option.kv_cache_tokens": "2048", "option.max_rolling_batch_prefill_tokens": "256"}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": %d}'
# Prompts that repeat themselves: prompt lookup finds a match at almost every decode step.
REPEATING = [PROMPTS[2], PROMPTS[0] * 3, "a b c d e f a b c d e f a b c d e f a b", PROMPTS[4] * 2]


class Counting(PerSequence):
    """Wraps the proposer: counts the calls, proposes what it would (or, where it finds nothing, the
    last token k times: a draft whenever asked)."""

    def __init__(self, inner):
        self.inner, self.method, self.calls = inner, inner.method, 0

    def draft(self, tokens, k):
        self.calls += 1
        return self.inner.draft(tokens, k) or [tokens[-1]] * k


class Recorder:
    """What the engine hands the runner each step, and how many sequences ran then."""

    def __init__(self, engine):
        self.engine, self.steps, self.running = engine, [], []
        step = engine.runner.step

        def rec(items, copies=()):
            self.steps.append(([(it.seq_id, tuple(it.token_ids), it.start_pos, tuple(it.block_table), it.sample,
                                 it.num_prompt, it.prompt_logprobs, tuple(it.draft)) for it in items], list(copies)))
            self.running.append(len(engine.scheduler.running))
            return step(items, copies)
        engine.runner.step = rec


def _engine(model_dir, tmp_path, spec_threshold: int | None):
    props = dict(PAGED)
    if spec_threshold is not None:
        props["option.speculative_config"] = NGRAM % spec_threshold
    d = tmp_path / ("off" if spec_threshold is None else f"on{spec_threshold}")
    d.mkdir()
    return make_engine(model_dir, d, props).run_by_hand()


def _drive(engine, prompts, new):
    """Submit every prompt before the first iteration (max_new_tokens `new`, one per prompt or one for
    all), run the iterations here; token ids per prompt."""
    news = new if isinstance(new, list) else [new] * len(prompts)
    chans = [engine.submit([engine.tokenize(p)], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
             for p, n in zip(prompts, news)]
    out = [[] for _ in prompts]
    live = set(range(len(prompts)))
    while live:
        engine.step()
        for i in list(live):
            while not chans[i].events.empty():
                ev = chans[i].events.get()
                assert not isinstance(ev, ErrorEvent), ev
                out[i].append(ev.id)
                if ev.done:
                    live.discard(i)
    return out


def test_configured_but_disabled_is_the_plain_engine_step_for_step(demo_model_dir, tmp_path):
    from handler.config import load_config
    off, on = _engine(demo_model_dir, tmp_path, None), _engine(demo_model_dir, tmp_path, 1)
    try:
        # The configuration differs in the speculative key alone.
        cfg = {name: load_config(str(tmp_path / d / "serving.properties"), demo_model_dir, env={})
               for name, d in (("off", "off"), ("on", "on1"))}
        diff = {f.name for f in dataclasses.fields(cfg["off"])
                if getattr(cfg["off"], f.name) != getattr(cfg["on"], f.name)}
        assert diff <= {"speculative", "speculative_config", "properties", "properties_file"}, diff
        assert cfg["on"].speculative is not None and cfg["on"].speculative.disable_by_batch_size == 1
        # Same KV pool, admission capacity and layer path.
        assert on.runner.kv.num_blocks == off.runner.kv.num_blocks
        assert on.blocks.num_blocks == off.blocks.num_blocks
        assert on.admission.kv_tokens == off.admission.kv_tokens
        assert type(getattr(on.runner.model, "decode_stack", None)) is type(getattr(off.runner.model,
                                                                                   "decode_stack", None))
        on.proposer = counting = Counting(on.proposer)
        rec_off, rec_on = Recorder(off), Recorder(on)
        got_off = _drive(off, REPEATING, 24)
        got_on = _drive(on, REPEATING, 24)
        assert got_on == got_off
        assert len(rec_on.steps) == len(rec_off.steps) >= 24
        for i, (a, b) in enumerate(zip(rec_off.steps, rec_on.steps)):
            assert a == b, f"step {i}: the runner was handed a different step"
        assert counting.calls == 0
        assert on.stats()["spec"]["ngram"] == {"verifies": 0, "proposed": 0, "accepted": 0}
        for k in ("steps", "prefill_tokens", "decode_tokens", "preemptions", "admitted"):
            assert on.stats()[k] == off.stats()[k], k
    finally:
        off.shutdown()
        on.shutdown()


def test_threshold_plans_equal_the_plain_ones_while_reached_and_speculate_below(demo_model_dir, tmp_path):
    """Four sequences of different lengths, off from 3 running: every step while 3 or more run is the
    plain engine's; once fewer run, drafts are proposed (the comparison sees a difference when there
    is one)."""
    off, on = _engine(demo_model_dir, tmp_path, None), _engine(demo_model_dir, tmp_path, 3)
    try:
        on.proposer = counting = Counting(on.proposer)
        rec_off, rec_on = Recorder(off), Recorder(on)
        new = [12, 20, 28, 36]       # they finish one after another: 4, 3, 2, 1 running
        outs = [_drive(engine, REPEATING, new) for engine in (off, on)]
        assert outs[0] == outs[1]          # greedy: the same tokens either way
        reached = 0
        for a, b, n in zip(rec_off.steps, rec_on.steps, rec_on.running):
            if n < 3:
                break
            assert a == b
            reached += 1
        assert reached >= 12
        assert counting.calls > 0 and on.stats()["spec"]["ngram"]["proposed"] > 0
        assert any(any(it[-1] for it in items) for items, _ in rec_on.steps[reached:])   # drafts handed over
    finally:
        off.shutdown()
        on.shutdown()


@pytest.mark.parametrize("threshold", [2, 16])
def test_the_scheduler_asks_the_proposer_nothing_at_or_above_the_threshold(threshold):
    """Scheduler alone: with `threshold` or more decoding, no call to the proposer and no draft, and a
    sequence's back-off counters are left as they were (they count its verify steps, not the batch's)."""
    from handler.config.speculative import SpecConfig
    from handler.engine.blocks import BlockManager
    from handler.engine.scheduler import Scheduler, SchedulerPolicy, Sequence
    from handler.engine.types import SampleResult

    class Always(PerSequence):
        method, calls = "ngram", 0

        def draft(self, tokens, k):
            self.calls += 1
            return [7] * k

    prop = Always()
    pol = SchedulerPolicy("paged", max_batch_size=64, prefill_token_budget=4096,
                          spec=SpecConfig("ngram", 4, 2, 3, threshold, None))
    s = Scheduler(pol, BlockManager(1024, 16))

    def schedule():     # as Engine.step: the proposer answers the scheduler's asks, then it plans
        asks = s.draft_asks()
        return s.schedule(0.0, drafts_of(asks, prop.propose(asks)))
    for i in range(threshold):
        s.add(Sequence(i, [1, 2, 3, 4], SamplingParams(max_new_tokens=50, ignore_eos=True), 0.0))
    for step in range(10):
        plan = schedule()
        assert len(plan.items) == threshold
        assert all(not it.draft for it in plan.items)
        s.update(plan, [SampleResult(token=5) for _ in plan.items])
    assert prop.calls == 0
    assert all(q.spec_skip == 0 and q.spec_misses == 0 for q in s.running)
    # One fewer running: speculation comes back.
    s.finish(0, "eos_token")
    plan = schedule()
    assert prop.calls == threshold - 1 and all(it.draft for it in plan.items)
