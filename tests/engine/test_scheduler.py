"""Scheduler: admission and step plans for none/dynamic/rolling/paged, with a fake runner and an
injected clock (the `now` passed to schedule). No torch."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from handler.engine.blocks import BlockManager
from handler.engine.request import SamplingParams
from handler.engine.admission import Admission
from handler.engine.scheduler import (STRATEGIES, CapacityError, QueueFull, Scheduler, SchedulerPolicy,
                               Sequence)
from handler.engine.types import SampleResult
from tests.support.fakes import FakeRunner, history_hash

EOS = 0
VOCAB = 16


def model(tokens) -> int:
    """A deterministic 'model': the next token is a function of the sequence's own tokens only."""
    return history_hash(tokens) % VOCAB  # EOS (0) now and then


def model_no_eos(tokens) -> int:
    return 1 + model(tokens) % (VOCAB - 1)


def make(strategy, num_blocks=64, block_size=4, caching=False, **kw) -> Scheduler:
    kw.setdefault("eos_token_ids", frozenset({EOS}))
    return Scheduler(SchedulerPolicy(strategy, **kw),
                     BlockManager(num_blocks, block_size, enable_prefix_caching=caching))


def seq(sid, prompt, max_new=4, arrival=0.0, **params) -> Sequence:
    if isinstance(prompt, int):
        prompt = [1 + (sid * 7 + i) % (VOCAB - 1) for i in range(prompt)]
    return Sequence(sid, list(prompt), SamplingParams(max_new_tokens=max_new, **params), arrival)


def ids(plan) -> list[int]:
    return [i.seq_id for i in plan.items]


def step(s: Scheduler, runner: FakeRunner, now=0.0):
    """One engine iteration: schedule, run, update, and finish the sequences that ended."""
    plan = s.schedule(now)
    done = []
    if plan.items:
        for q, _ in s.update(plan, runner.step(plan.items, plan.copies)):
            if q.finished:
                done.append(s.finish(q.seq_id, q.finish_reason).seq_id)
    return plan, done


def alone(prompt, params: SamplingParams, max_model_len: int, fn=model):
    """What a sequence generates by itself: (output tokens, finish reason)."""
    toks = list(prompt)
    while True:
        t = fn(toks)
        toks.append(t)
        n = len(toks) - len(prompt)
        if t == EOS and not params.ignore_eos:
            return toks[len(prompt):], "eos_token"
        if params.eos_after is not None and n >= params.eos_after:
            return toks[len(prompt):], "eos_token"
        if n >= params.max_new_tokens or len(toks) >= max_model_len:
            return toks[len(prompt):], "length"


# ---------------------------------------------------------------- policy and intake
def test_policy_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        SchedulerPolicy("continuous")


def admission(num_blocks=64, block_size=4, max_model_len=2048, max_batch_size=32, max_waiting=1000):
    """The engine's admission for a scheduler made by make(...) with these figures."""
    return Admission(max_batch_size, max_waiting, max_model_len, num_blocks * block_size)


def test_check_fits():
    a = admission(num_blocks=4, block_size=4, max_model_len=8)          # 16 KV slots
    with pytest.raises(CapacityError, match="at most 7 prompt tokens"):
        a.check_fits(8, SamplingParams())
    a.check_fits(7, SamplingParams(max_new_tokens=1))
    with pytest.raises(CapacityError, match="ask for at most 1"):
        a.check_fits(7, SamplingParams(max_new_tokens=2))              # beyond max_model_len
    a = admission(num_blocks=4, block_size=4, max_model_len=64)
    a.check_fits(10, SamplingParams(max_new_tokens=6))                 # exactly 16
    with pytest.raises(CapacityError, match="max_new_tokens"):
        a.check_fits(10, SamplingParams(max_new_tokens=7))
    with pytest.raises(CapacityError):                                 # all or none
        a.admit([3, 10], SamplingParams(max_new_tokens=7))
    assert a.live == 0


def test_empty_prompt_rejected():
    a = admission()
    with pytest.raises(CapacityError, match="no tokens"):
        a.admit([0], SamplingParams())
    assert a.live == 0


def test_queue_full():
    a = admission(max_waiting=2, max_batch_size=1)   # capacity: 1 running + 2 waiting, in sequences
    a.admit([3, 3], SamplingParams())
    a.admit([3], SamplingParams())                                     # exactly at capacity: admitted
    with pytest.raises(QueueFull, match="job_queue_size"):
        a.admit([3], SamplingParams())
    assert a.live == 3
    a.release()                                                        # one ended: room for one
    with pytest.raises(QueueFull):
        a.admit([3], SamplingParams(n=2))                              # two samples: two sequences
    a.admit([3], SamplingParams())
    assert a.live == 3
    assert admission(max_waiting=2).capacity == 34                     # 32 slots + 2


# ---------------------------------------------------------------- none
def test_none_one_at_a_time_fifo():
    s, r = make("none"), FakeRunner(4, model_no_eos)
    for sid, n in ((1, 5), (2, 3), (3, 6)):
        s.add(seq(sid, n, max_new=2))
    order = []
    for _ in range(20):
        plan, done = step(s, r)
        if not plan.items:
            break
        assert len(plan.items) == 1
        order.append(plan.items[0].seq_id)
        assert len(s.running) <= 1
    # each: one prefill step with the whole prompt, one decode step
    assert order == [1, 1, 2, 2, 3, 3]
    assert [len(c[0].token_ids) for c in r.calls] == [5, 1, 3, 1, 6, 1]
    assert not s.has_work and s.blocks.num_free == s.blocks.num_blocks


# ---------------------------------------------------------------- dynamic
def test_dynamic_full_batch_forms_at_once():
    s = make("dynamic", max_batch_size=4, max_batch_delay_s=0.1)
    for sid in range(1, 5):
        s.add(seq(sid, 3, arrival=0.0))
    assert ids(s.schedule(0.0)) == [1, 2, 3, 4]


def test_dynamic_waits_for_delay():
    s = make("dynamic", max_batch_size=4, max_batch_delay_s=0.1)
    s.add(seq(1, 3, arrival=0.0))
    s.add(seq(2, 3, arrival=0.02))
    assert s.schedule(0.05).items == [] and not s.running
    assert s.next_wakeup(0.05) == pytest.approx(0.05)                  # from the first arrival
    assert s.next_wakeup(0.3) == 0.0
    assert ids(s.schedule(0.1)) == [1, 2]
    assert s.next_wakeup(0.1) is None                                  # a batch is running


def test_dynamic_more_than_batch_size():
    s, r = make("dynamic", max_batch_size=4, max_batch_delay_s=0.1), FakeRunner(4, model_no_eos)
    for sid in range(1, 7):
        s.add(seq(sid, 3, max_new=1))
    plan, done = step(s, r, 0.0)
    assert ids(plan) == [1, 2, 3, 4] and done == [1, 2, 3, 4]
    assert s.schedule(0.05).items == []    # 2 left (< batch_size): wait for the delay from t=0
    assert ids(s.schedule(0.1)) == [5, 6]


def test_dynamic_no_join_until_batch_ends():
    s, r = make("dynamic", max_batch_size=4, max_batch_delay_s=0.1), FakeRunner(4, model_no_eos)
    s.add(seq(1, 3, max_new=3))
    s.add(seq(2, 3, max_new=1))
    plan, done = step(s, r, 0.1)
    assert ids(plan) == [1, 2] and done == [2]
    s.add(seq(3, 2, arrival=0.15))
    s.add(seq(4, 2, arrival=0.15))
    s.add(seq(5, 2, arrival=0.15))
    s.add(seq(6, 2, arrival=0.15))         # a full batch's worth waits, with a slot free
    plan, done = step(s, r, 0.2)
    assert ids(plan) == [1] and done == []
    assert s.next_wakeup(0.2) is None
    plan, done = step(s, r, 0.3)
    assert ids(plan) == [1] and done == [1]
    plan, _ = step(s, r, 0.31)             # all members finished: the next batch forms
    assert ids(plan) == [3, 4, 5, 6]


def test_dynamic_next_batch_waits_its_own_delay():
    s, r = make("dynamic", max_batch_size=4, max_batch_delay_s=0.1), FakeRunner(4, model_no_eos)
    s.add(seq(1, 3, max_new=2))
    step(s, r, 0.1)
    s.add(seq(2, 3, arrival=0.15))
    plan, done = step(s, r, 0.2)
    assert ids(plan) == [1] and done == [1]
    assert s.schedule(0.22).items == []                                # 2 alone, arrived at 0.15
    assert s.next_wakeup(0.22) == pytest.approx(0.03)
    assert ids(s.schedule(0.25)) == [2]


# ---------------------------------------------------------------- rolling
def test_rolling_join_and_leave_each_step():
    s, r = make("rolling", max_batch_size=2), FakeRunner(4, model_no_eos)
    s.add(seq(1, 3, max_new=1))
    s.add(seq(2, 4, max_new=3))
    s.add(seq(3, 2, max_new=2))
    plan, done = step(s, r)
    assert ids(plan) == [1, 2] and done == [1]
    assert [q.seq_id for q in s.waiting] == [3]                        # the cap held it back
    plan, done = step(s, r)                                            # 3 joins as 1 left
    assert ids(plan) == [2, 3] and done == []
    assert [(len(i.token_ids), i.start_pos) for i in plan.items] == [(1, 4), (2, 0)]
    plan, done = step(s, r)
    assert ids(plan) == [2, 3] and done == [2, 3]
    assert not s.has_work


def test_rolling_max_batch_size():
    s = make("rolling", max_batch_size=2)
    for sid in range(5):
        s.add(seq(sid, 3))
    assert ids(s.schedule(0.0)) == [0, 1] and len(s.waiting) == 3


def test_rolling_chunked_prefill():
    s, r = make("rolling", prefill_token_budget=4), FakeRunner(4, model_no_eos)
    a, b = seq(1, 10, max_new=2), seq(2, 6, max_new=2)
    s.add(a)
    s.add(b)
    chunks, waiting = [], []
    for _ in range(6):
        plan, _ = step(s, r)
        waiting.append([q.seq_id for q in s.waiting])
        chunks.append([(i.seq_id, i.token_ids, i.start_pos, i.sample) for i in plan.items])
        assert sum(len(i.token_ids) for i in plan.items if len(i.token_ids) > 1) <= 4
    p, q = a.prompt_ids, b.prompt_ids
    assert chunks[0] == [(1, p[0:4], 0, False)]            # 2 is not admitted: no budget left
    # 2 joins at the second step (1 holds only its floor, 4 // OLDEST_PREFILL_SHARE, against
    # newcomers), but 1 has as few tokens left and is older: it takes the budget first.
    assert waiting[:3] == [[2], [], []]
    assert chunks[1] == [(1, p[4:8], 4, False)]
    assert chunks[2] == [(1, p[8:10], 8, True), (2, q[0:2], 0, False)]
    assert chunks[3] == [(1, [a.tokens[10]], 10, True), (2, q[2:6], 2, True)]
    assert chunks[4] == [(2, [b.tokens[6]], 6, True)]                  # 1 finished after 2 tokens
    assert chunks[5] == []
    assert a.output_ids == alone(p, a.params, 2048, model_no_eos)[0]
    assert s.stats["prefill_tokens"] == 16 and s.stats["decode_tokens"] == 2


def test_rolling_reserves_max_length_at_admission():
    s, r = make("rolling", num_blocks=10, block_size=4), FakeRunner(4, model_no_eos)
    s.add(seq(1, 8, max_new=12))          # 20 tokens: 5 blocks
    s.add(seq(2, 8, max_new=16))          # 24 tokens: 6 blocks, only 5 left
    plan = s.schedule(0.0)
    assert ids(plan) == [1] and [q.seq_id for q in s.waiting] == [2]
    assert len(s.blocks.table(1)) == 5
    assert s.kv_usage() == {"kv_tokens_stored": 0, "kv_tokens_allocated": 20,
                            "kv_tokens_total": 40, "kv_utilization": 0.0}
    s.update(plan, r.step(plan.items))
    assert s.kv_usage()["kv_tokens_stored"] == 8
    assert s.kv_usage()["kv_utilization"] == pytest.approx(8 / 20)
    for _ in range(11):
        plan, done = step(s, r)
        assert ids(plan) == [1] and len(plan.items[0].block_table) == 5  # no growth, no joining
    assert done == [1]
    plan, _ = step(s, r)
    assert ids(plan) == [2] and len(s.blocks.table(2)) == 6
    assert s.kv_usage()["kv_tokens_allocated"] == 24


def test_rolling_prefix_cache_hit_skips_computed_prompt():
    s, r = make("rolling", caching=True, block_size=4), FakeRunner(4, model_no_eos)
    shared = [3, 1, 4, 1, 5, 9, 2, 6]
    a = seq(1, shared + [5, 3], max_new=3)
    s.add(a)
    step(s, r)                                                         # 1's prompt is computed
    b = seq(2, shared + [8], max_new=3)
    s.add(b)
    plan, _ = step(s, r)
    item = next(i for i in plan.items if i.seq_id == 2)
    assert (item.start_pos, item.token_ids) == (8, [8])
    assert b.cached_tokens == 8 and s.stats["cached_prompt_tokens"] == 8
    assert s.blocks.table(2)[:2] == s.blocks.table(1)[:2]
    while s.has_work:
        step(s, r)
    assert b.output_ids == alone(b.prompt_ids, b.params, 2048, model_no_eos)[0]
    assert s.blocks.num_free == s.blocks.num_blocks


def test_kv_usage_counts_shared_prefix_blocks_once():
    s, r = make("paged", num_blocks=8, block_size=2, caching=True), FakeRunner(2, model_no_eos)
    s.add(seq(1, [1, 2, 3, 4, 5], max_new=3))
    step(s, r)                                     # 1's two full blocks are now cached
    s.add(seq(2, [1, 2, 3, 4, 6], max_new=3))
    s.add(seq(3, [1, 2, 3, 4, 7], max_new=3))
    plan = s.schedule(0.0)
    assert ids(plan) == [1, 2, 3] and [q.cached_tokens for q in s.running] == [0, 4, 4]
    # 3 + 1 + 1 physical blocks; 4 shared prompt tokens + 1 more of seq 1 written
    assert s.kv_usage() == {"kv_tokens_stored": 5, "kv_tokens_allocated": 10,
                            "kv_tokens_total": 16, "kv_utilization": 0.5}
    s.update(plan, r.step(plan.items))
    assert s.kv_usage()["kv_tokens_stored"] == 4 + 2 + 1 + 1


# ---------------------------------------------------------------- paged
def test_paged_allocates_on_demand():
    s, r = make("paged", block_size=4), FakeRunner(4, model_no_eos)
    s.add(seq(1, 5, max_new=8))
    sizes = []
    while s.has_work:
        plan, _ = step(s, r)
        if plan.items:
            it = plan.items[0]
            sizes.append((it.start_pos + len(it.token_ids), len(it.block_table)))
    # the table covers exactly the tokens fed so far, one block at a time
    assert sizes == [(5, 2), (6, 2), (7, 2), (8, 2), (9, 3), (10, 3), (11, 3), (12, 3)]
    assert s.blocks.num_free == 64


def test_paged_preempts_newest_and_resumes_with_its_output():
    s, r = make("paged", num_blocks=4, block_size=2), FakeRunner(2, model_no_eos)
    a, b, c = seq(1, 2, max_new=4), seq(2, 2, max_new=4), seq(3, 3, max_new=1)
    for q in (a, b, c):
        s.add(q)
    plan, _ = step(s, r)
    # 3 needs 2 blocks + a 1-block watermark, but only 2 are free: it waits
    assert ids(plan) == [1, 2] and [q.seq_id for q in s.waiting] == [3]
    step(s, r)                                                         # 4 tokens each
    step(s, r)                                                         # 5 tokens, 4 computed
    assert s.blocks.num_free == 0
    plan, _ = step(s, r)                                               # 1 needs a 3rd block
    assert plan.preempted == [2] and ids(plan) == [1]
    assert [q.seq_id for q in s.waiting] == [2, 3]                     # requeued first
    assert b.num_computed == 0 and b.preemptions == 1 and 2 not in s.blocks.tables
    assert b.num_output == 3
    resumed = None
    while s.has_work:
        plan, _ = step(s, r)
        s.blocks.check_invariants()
        for it in plan.items:
            if it.seq_id == 2 and resumed is None:
                resumed = it
    assert (resumed.start_pos, resumed.token_ids) == (0, b.tokens[:5])  # prompt + its output
    assert resumed.sample
    for q in (a, b, c):
        assert q.output_ids == alone(q.prompt_ids, q.params, 2048, model_no_eos)[0]
    assert s.stats["preemptions"] == 1
    assert s.blocks.num_free == 4


def test_paged_victim_is_most_recently_admitted():
    s, r = make("paged", num_blocks=6, block_size=2), FakeRunner(2, model_no_eos)
    for sid in (1, 2, 3):
        s.add(seq(sid, 2, max_new=6))
    step(s, r)
    assert [q.seq_id for q in s.running] == [1, 2, 3]
    preempted = []
    while s.has_work:
        plan, _ = step(s, r)
        if plan.preempted:
            newest = sorted(s.running + [s.waiting[0]], key=lambda q: q.admitted)[-1]
            preempted.append(plan.preempted)
            assert plan.preempted == [newest.seq_id]
    assert preempted[0] == [3]


# ---------------------------------------------------------------- cancellation
def test_abort_waiting_and_running():
    s = make("rolling", num_blocks=8, max_batch_size=1)
    s.add(seq(1, 5))
    s.add(seq(2, 5))
    s.schedule(0.0)
    assert s.blocks.num_free < 8
    w = s.finish(2, "aborted")
    assert w.finish_reason == "aborted" and not s.waiting and 2 not in s.seqs
    run = s.finish(1, "aborted")
    assert run.finish_reason == "aborted" and not s.running
    assert s.blocks.num_free == 8 and s.blocks.tables == {}
    assert s.finish(1, "aborted") is None and not s.has_work


def test_update_ignores_sequence_aborted_during_step():
    s, r = make("rolling"), FakeRunner(4, model_no_eos)
    a, b = seq(1, 3), seq(2, 3)
    s.add(a)
    s.add(b)
    plan = s.schedule(0.0)
    sampled = r.step(plan.items)
    s.finish(1, "aborted")
    got = [q for q, _ in s.update(plan, sampled)]
    assert got == [b] and b.output_ids == [sampled[1].token]     # 1's token is not handed to 2
    assert a.output_ids == [] and a.finish_reason == "aborted"
    assert s.blocks.num_free == 64 - len(s.blocks.table(2))


def test_finish_keeps_the_first_reason():
    s, r = make("rolling"), FakeRunner(4, model_no_eos)
    s.add(seq(1, 3, max_new=1))
    plan = s.schedule(0.0)
    ((q, _),) = s.update(plan, r.step(plan.items))
    assert q.finish_reason == "length"
    assert s.finish(1, "aborted").finish_reason == "length"


# ---------------------------------------------------------------- finish reasons
def _run_with_tokens(params_kw, tokens):
    s = make("rolling")
    q = seq(1, 3, **params_kw)
    s.add(q)
    for t in tokens:
        plan = s.schedule(0.0)
        s.update(plan, [SampleResult(t)])
        if q.finished:
            break
    return q


@pytest.mark.parametrize("params,tokens,reason,n_out", [
    ({"max_new": 5}, [4, 5, EOS, 6, 7], "eos_token", 3),
    ({"max_new": 5, "ignore_eos": True}, [4, EOS, EOS, 6, 7], "length", 5),
    ({"max_new": 5}, [4, 5, 6, 7, 8], "length", 5),
    ({"max_new": 5, "eos_after": 2}, [4, 5, 6, 7, 8], "eos_token", 2),
    ({"max_new": 5, "eos_after": 2, "ignore_eos": True}, [4, 5, 6], "eos_token", 2),
])
def test_finish_reasons(params, tokens, reason, n_out):
    q = _run_with_tokens(params, tokens)
    assert (q.finish_reason, q.num_output) == (reason, n_out)


# ---------------------------------------------------------------- whole runs, any workload
def drive(s: Scheduler, requests: list[Sequence], runner: FakeRunner, aborts=None, dt=0.01,
          max_steps=5000):
    """Run to completion with arrivals at their times; check per-step invariants. `aborts` maps
    seq_id -> (step, during): cancel it before that step's schedule, or while the step runs."""
    p, strategy = s.policy, s.policy.strategy
    pending = sorted(requests, key=lambda q: q.arrival)
    finished: dict[int, Sequence] = {}
    aborted: set[int] = set()
    admitted_order: list[int] = []
    now = 0.0

    def cancel(k, during):
        for sid, (at, d) in (aborts or {}).items():
            if at == k and d == during and sid in s.seqs:
                assert s.finish(sid, "aborted").finish_reason == "aborted"
                aborted.add(sid)

    for k in range(max_steps):
        if not pending and not s.has_work:
            break
        while pending and pending[0].arrival <= now:
            s.add(pending.pop(0))
        cancel(k, during=False)
        before = {q.seq_id for q in s.running}
        plan = s.schedule(now)
        after = {q.seq_id for q in s.running}
        joined = (after | set(plan.preempted)) - before
        admitted_order += sorted(joined, key=lambda i: s.seqs[i].admitted)
        s.blocks.check_invariants()
        assert len(s.running) <= (1 if strategy == "none" else p.max_batch_size)
        if strategy in ("none", "dynamic"):
            assert not joined or not before            # nobody joins a running batch
        if strategy != "paged":
            assert plan.preempted == []
        else:                                          # victims: the newest of those running
            pool = sorted((s.seqs[i] for i in after | set(plan.preempted)),
                          key=lambda q: q.admitted)
            assert {q.seq_id for q in pool[len(pool) - len(plan.preempted):]} == set(plan.preempted)
        if strategy == "rolling":
            for q in s.running:                        # reserved for the maximum length
                assert len(s.blocks.table(q.seq_id)) == s.blocks.blocks_for(s.max_len(q))
        if strategy in ("rolling", "paged"):
            assert sum(len(i.token_ids) for i in plan.items if len(i.token_ids) > 1) \
                <= p.prefill_token_budget
        assert len(set(ids(plan))) == len(plan.items)
        for it in plan.items:
            assert it.start_pos == s.seqs[it.seq_id].num_computed
        sharing = s.blocks.prefix_caching or any(q.fork_of is not None for q in requests)
        if not sharing:                                # without sharing, tables are disjoint
            held = [b for q in s.running for b in s.blocks.table(q.seq_id)]
            assert len(held) == len(set(held))
        u = s.kv_usage()
        assert u["kv_tokens_stored"] <= u["kv_tokens_allocated"] <= u["kv_tokens_total"]
        if not sharing:
            assert u["kv_tokens_stored"] == sum(q.num_computed for q in s.running)
            assert u["kv_tokens_allocated"] == \
                sum(len(s.blocks.table(q.seq_id)) for q in s.running) * s.blocks.block_size
        if plan.items:
            sampled = runner.step(plan.items, plan.copies)
            cancel(k, during=True)
            running = {q.seq_id for q in s.running}
            got = s.update(plan, sampled)
            forked = {q.seq_id for q in s.running} - running      # samples forked after a prefill
            assert p.strategy == "paged" or not forked
            admitted_order += sorted(forked, key=lambda i: s.seqs[i].admitted)
            for q, _ in got:
                assert q.seq_id not in aborted
                if q.finished:
                    finished[q.seq_id] = s.finish(q.seq_id, q.finish_reason)
        elif strategy != "dynamic":                    # only dynamic may idle while work waits
            assert not s.running and not s.waiting, "stalled"
        now = round(now + dt, 6)
    else:
        raise AssertionError("did not finish")
    assert not s.seqs and not s.blocks.tables
    assert s.blocks.num_free == s.blocks.num_blocks
    s.blocks.check_invariants()
    assert len(finished) + len(aborted) == len(requests)           # nobody is lost
    return finished, admitted_order


def test_drive_each_strategy_smoke():
    for strategy in STRATEGIES:
        s = make(strategy, num_blocks=12, block_size=2, max_batch_size=3, prefill_token_budget=5)
        reqs = [seq(i, 3 + i % 4, max_new=2 + i % 5, arrival=0.005 * i) for i in range(10)]
        finished, order = drive(s, reqs, FakeRunner(2, model))
        assert sorted(finished) == list(range(10))
        for q in reqs:
            assert (q.output_ids, q.finish_reason) == alone(q.prompt_ids, q.params, 2048), strategy
        if strategy != "paged":
            assert order == list(range(10))            # FIFO admission


@st.composite
def workloads(draw, strategy, tight=False):
    """Random requests, some sharing a prompt prefix; `tight` crowds many long-running requests
    into few small blocks so that paged has to preempt."""
    bs = draw(st.integers(1, 2 if tight else 4))
    max_model_len = draw(st.integers(4, 24))
    prefix = draw(st.lists(st.integers(1, 3), max_size=8))
    reqs, aborts = [], {}
    for i in range(draw(st.integers(3 if tight else 1, 8))):
        own = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=10))
        prompt = ((prefix if draw(st.booleans()) else []) + own)[:max_model_len - 1]
        params = {"max_new": draw(st.integers(1, min(10, max_model_len - len(prompt))))}
        if tight or draw(st.booleans()):
            params["ignore_eos"] = True
        if not tight and draw(st.integers(0, 4)) == 0:
            params["eos_after"] = draw(st.integers(1, 5))
        arrival = 0.0 if tight else draw(st.sampled_from([0.0, 0.01, 0.02, 0.05, 0.2]))
        first = len(reqs)
        samples = 1 if strategy == "none" else draw(st.integers(1, 3))   # none: one request at a time
        for j in range(samples):                       # samples of one prompt (n), forked on paged
            reqs.append(Sequence(len(reqs), list(prompt), SamplingParams(max_new_tokens=params["max_new"],
                                 **{k: v for k, v in params.items() if k != "max_new"}), arrival,
                                 sample_index=j, fork_of=first if j else None))
            if not tight and draw(st.integers(0, 5)) == 0:
                aborts[len(reqs) - 1] = (draw(st.integers(0, 12)), draw(st.booleans()))
    need = max(len(q.prompt_ids) + q.params.max_new_tokens for q in reqs)
    num_blocks = -(-need // bs) + draw(st.integers(0, 1 if tight else 4))
    s = make(strategy, num_blocks=num_blocks, block_size=bs, caching=draw(st.booleans()),
             max_batch_size=draw(st.integers(2 if tight else 1, 4)),
             prefill_token_budget=draw(st.integers(1, 12)),
             max_batch_delay_s=draw(st.sampled_from([0.0, 0.03, 0.1])), max_model_len=max_model_len)
    return s, reqs, aborts


@pytest.mark.parametrize("strategy,tight", [(s, False) for s in STRATEGIES] + [("paged", True)])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_workload_matches_running_alone(strategy, tight, data):
    s, reqs, aborts = data.draw(workloads(strategy, tight))
    finished, order = drive(s, reqs, FakeRunner(s.blocks.block_size, model), aborts)
    for q in reqs:
        out, reason = alone(q.prompt_ids, q.params, s.policy.max_model_len)
        if q.seq_id in finished:
            assert (q.output_ids, q.finish_reason) == (out, reason)
        else:                                          # cancelled part-way: a prefix of it
            assert q.seq_id in aborts and q.finish_reason == "aborted"
            assert q.output_ids == out[:q.num_output] and q.num_output < len(out)
    first_admission = list(dict.fromkeys(order))
    assert first_admission == sorted(first_admission, key=lambda i: (reqs[i].arrival, i))
    if s.policy.strategy != "paged":
        assert s.stats["forked_prompt_tokens"] == 0
    if s.policy.strategy != "paged":
        assert s.stats["preemptions"] == 0 and len(order) == len(set(order))


def test_none_runs_a_client_side_list_as_one_batch():
    s, r = make("none"), FakeRunner(4, model_no_eos)
    listed = [Sequence(i, [1 + i, 2, 3], SamplingParams(max_new_tokens=3), 0.0, group=10) for i in (10, 11, 12)]
    alone = seq(13, 3, max_new=2)
    for q in listed + [alone]:
        s.add(q)
    plan, _ = step(s, r)
    assert ids(plan) == [10, 11, 12]            # the whole list, not the next request
    while s.running:
        step(s, r)
    plan, _ = step(s, r)
    assert ids(plan) == [13]


# ---------------------------------------------------------------- samples of one prompt (n)
@pytest.mark.parametrize("plen", [5, 8, 9, 12])       # block_size 4: last shared block partial or not
def test_paged_samples_prefill_once_then_fork_with_copy_on_write(plen):
    s, r = make("paged", num_blocks=40, block_size=4, max_batch_size=8), FakeRunner(4, model_no_eos)
    prompt = [1 + i % (VOCAB - 1) for i in range(plen)]
    samples = [Sequence(10 + j, list(prompt), SamplingParams(max_new_tokens=6), 0.0, sample_index=j,
                        fork_of=10 if j else None) for j in range(3)]
    for q in samples:
        s.add(q)
    plan, _ = step(s, r)
    assert ids(plan) == [10]                   # the other samples wait for sample 0's prefill
    assert [q.seq_id for q in s.running] == [10, 11, 12]     # forked right after it
    t0 = s.blocks.table(10)
    for child in (11, 12):
        t = s.blocks.table(child)
        full = (plen - 1) // 4
        assert t[:full] == t0[:full]           # full prompt blocks shared
        assert s.blocks.ref[t0[0]] == 3 if full else True
        assert set(t[full:]).isdisjoint(t0)    # the partly filled one copied, not shared
    assert len(s._copies) == (2 if (plen - 1) % 4 else 0)
    plan, _ = step(s, r)
    assert [(i.seq_id, len(i.token_ids)) for i in plan.items] == [(10, 1), (11, 1), (12, 1)]
    assert len(plan.copies) == (2 if (plen - 1) % 4 else 0)
    while s.has_work:
        step(s, r)
    want = alone(prompt, samples[0].params, 2048, model_no_eos)
    assert all((q.output_ids, q.finish_reason) == want for q in samples)
    assert s.stats["forked_prompt_tokens"] == 2 * (plen - 1)
    assert s.stats["prefill_tokens"] == plen + 2     # each fork recomputes only the last prompt token
    assert s.blocks.num_free == s.blocks.num_blocks
    s.blocks.check_invariants()


def test_prompt_longer_than_the_kv_pool_is_blamed_on_inputs():
    a = admission(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(CapacityError, match=r"^inputs: the prompt has 20 tokens; the KV cache holds 16"):
        a.check_fits(20, SamplingParams(max_new_tokens=5))
    with pytest.raises(CapacityError, match=r"^parameters.max_new_tokens"):
        a.check_fits(10, SamplingParams(max_new_tokens=10))


def test_policy_behaviour_comes_from_fields_not_the_strategy_name():
    assert SchedulerPolicy("paged", prefix_caching=True).prefix_caching
    assert not SchedulerPolicy("rolling", prefix_caching=True).prefix_caching   # reserves full length
    assert not SchedulerPolicy("rolling", fork_samples=True).fork_samples
    s = Scheduler(SchedulerPolicy("paged", chunked_prefill=False, prefill_token_budget=2),
                  BlockManager(64, 4))
    s.add(seq(1, 10))
    assert [len(i.token_ids) for i in s.schedule(0.0).items] == [10]           # not chunked
    s = Scheduler(SchedulerPolicy("paged", reserve_full_length=True), BlockManager(64, 4))
    s.add(seq(1, 10, max_new=10))
    s.schedule(0.0)
    assert len(s.blocks.table(1)) == 5                                         # 20 tokens reserved


def test_a_short_prompt_beside_a_long_one_is_prefilled_at_once_and_the_long_one_still_advances():
    """Chunked prefill shares: the long prompt, running first, keeps at least a quarter
    of the budget each step; a short prompt arriving mid-way is admitted and prefilled whole in
    its first step, so its first token does not wait for the long prefill."""
    s, r = make("rolling", prefill_token_budget=16, num_blocks=64), FakeRunner(4, model_no_eos)
    long_, short = seq(1, 100, max_new=2), seq(2, 6, max_new=2)
    s.add(long_)
    plan, _ = step(s, r)
    assert [(i.seq_id, len(i.token_ids)) for i in plan.items] == [(1, 16)]
    s.add(short)
    plan, _ = step(s, r)
    assert [(i.seq_id, len(i.token_ids), i.sample) for i in plan.items] == [(1, 10, False), (2, 6, True)]
    assert short.num_output == 1 and long_.num_computed == 26          # its first token, now
    # Many short prompts at once: the long one still gets its floor of 4 tokens a step.
    for sid in range(3, 9):
        s.add(seq(sid, 6, max_new=2))
    plan, _ = step(s, r)
    got = {i.seq_id: len(i.token_ids) for i in plan.items if len(i.token_ids) > 1}
    assert got[1] == 4 and sum(got.values()) == 16
    while s.has_work:
        step(s, r)
    assert long_.output_ids == alone(long_.prompt_ids, long_.params, 2048, model_no_eos)[0]
