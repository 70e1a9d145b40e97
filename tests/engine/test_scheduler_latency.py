"""Latency policies of the scheduler (handler/engine/scheduler.py, stepcost.py): a target TPOT sizing
each step's prefill from the measured step cost, priority classes with preemption, and the aging bound.
A synthetic clock: each step "takes" COST(rows, prefill tokens) seconds, fed back as the engine does.
No torch."""
from __future__ import annotations

import random

import pytest

from handler.engine.blocks import BlockManager
from handler.engine.request import SamplingParams
from handler.engine.scheduler import SIT_OUT_STEPS, Scheduler, SchedulerPolicy, Sequence, min_prefill_tokens
from handler.engine.stepcost import MIN_STEPS, StepCostModel
from tests.support.fakes import FakeRunner, history_hash

EOS = 0
VOCAB = 16
# The synthetic host: seconds = A + B * decode rows + C * prefill tokens.
A, B, C = 0.004, 0.001, 0.0002


def cost(rows: int, tokens: int) -> float:
    return A + B * rows + C * tokens


def model(tokens) -> int:
    return 1 + history_hash(tokens) % (VOCAB - 1)     # never EOS: lengths are max_new_tokens


def alone(prompt, max_new) -> list[int]:
    toks = list(prompt)
    for _ in range(max_new):
        toks.append(model(toks))
    return toks[len(prompt):]


def make(strategy="paged", num_blocks=256, block_size=4, **kw) -> Scheduler:
    kw.setdefault("eos_token_ids", frozenset({EOS}))
    return Scheduler(SchedulerPolicy(strategy, **kw), BlockManager(num_blocks, block_size))


def seq(sid, n_prompt, max_new=8, arrival=0.0, priority=0) -> Sequence:
    prompt = [1 + (sid * 7 + i) % (VOCAB - 1) for i in range(n_prompt)]
    return Sequence(sid, prompt, SamplingParams(max_new_tokens=max_new, priority=priority), arrival)


class Clock:
    """Runs a scheduler against the synthetic host: each step advances `now` by its cost."""

    def __init__(self, s: Scheduler, block_size=4):
        self.s, self.now = s, 0.0
        self.runner = FakeRunner(block_size, model)
        self.plans, self.outputs, self.first_token = [], {}, {}

    def step(self):
        plan = self.s.schedule(self.now)
        if not plan.items:
            self.now += 0.001
            return plan
        rows = sum(1 for it in plan.items if len(it.token_ids) == 1)
        took = cost(rows, sum(len(it.token_ids) for it in plan.items) - rows)
        self.now += took
        self.s.observe_step(plan, took)
        self.plans.append((plan, rows, took))
        for q, _ in self.s.update(plan, self.runner.step(plan.items, plan.copies)):
            self.first_token.setdefault(q.seq_id, self.now)
            if q.finished:
                self.outputs[q.seq_id] = self.s.finish(q.seq_id, q.finish_reason).output_ids
        return plan

    def run(self, until=lambda: False, max_steps=5000):
        for _ in range(max_steps):
            if not self.s.has_work or until():
                return
            self.step()
        raise AssertionError("did not finish")


# ---------------------------------------------------------------- the cost model
def test_cost_model_recovers_a_linear_host_and_sizes_the_prefill():
    rng = random.Random(0)
    m = StepCostModel()
    assert m.prefill_budget(10, 0.05) is None        # nothing seen: no estimate
    for _ in range(200):
        rows, tokens = rng.randint(1, 40), rng.choice([0, 0, rng.randint(1, 300)])
        m.observe(rows, tokens, cost(rows, tokens) * rng.uniform(0.97, 1.03))
    assert m.predict(20, 100) == pytest.approx(cost(20, 100), rel=0.05)
    # 50 ms with 20 decode rows leaves (0.05 - 0.004 - 0.020) / 0.0002 = 130 prompt tokens.
    assert m.prefill_budget(20, 0.05) == pytest.approx(130, rel=0.1)
    assert m.prefill_budget(60, 0.05) == 0           # the decode rows alone take 64 ms


def test_cost_model_waits_for_enough_steps_and_follows_a_slower_host():
    m = StepCostModel()
    for i in range(MIN_STEPS - 1):
        m.observe(4 + i, 10 * i, cost(4 + i, 10 * i))
    assert m.predict(4, 0) is None
    for i in range(400):       # the host slows down 3x (another tenant): the fit follows it
        rows, tokens = 1 + i % 30, (i * 37) % 200
        m.observe(rows, tokens, 3 * cost(rows, tokens))
    assert m.predict(10, 50) == pytest.approx(3 * cost(10, 50), rel=0.05)


# ---------------------------------------------------------------- target TPOT
def test_target_tpot_bounds_every_step_and_keeps_outputs():
    target = 0.03          # 26 decode rows fill it; prompts of 40-120 tokens keep arriving
    s = make(max_batch_size=64, prefill_token_budget=4096, target_tpot_s=target, aging_s=10.0)
    clock = Clock(s)
    rng = random.Random(1)
    prompts = {}
    for sid in range(1, 61):
        n = rng.randint(40, 120)
        q = seq(sid, n, max_new=rng.randint(8, 24), arrival=0.0)
        prompts[sid] = (q.prompt_ids, q.params.max_new_tokens)
        s.add(q)
    clock.run()
    assert set(clock.outputs) == set(prompts)                    # every one answered ...
    for sid, (prompt, k) in prompts.items():
        assert clock.outputs[sid] == alone(prompt, k), sid       # ... with its own tokens
    learnt = [t for _, _, t in clock.plans[MIN_STEPS + 1:]]
    # Once learnt, a step overruns the target by at most one prompt token's cost (integer budget)
    # or when its decode rows alone fill it; without the target the first step alone takes 0.8 s.
    for (plan, rows, took) in clock.plans[MIN_STEPS + 1:]:
        assert took <= target + C + 1e-9 or cost(rows, 0) >= target - C, (rows, took)
    assert max(learnt) < 2 * target


def test_decode_rows_are_never_left_out_for_prefill():
    s = make(max_batch_size=64, prefill_token_budget=4096, target_tpot_s=0.02)
    clock = Clock(s)
    for sid in range(1, 9):
        s.add(seq(sid, 8, max_new=40))
    for _ in range(20):
        clock.step()
    for sid in range(9, 30):           # a burst of long prompts while 8 decode
        s.add(seq(sid, 200, max_new=4, arrival=clock.now))
    for _ in range(20):
        plan = clock.step()
        decoding = [q.seq_id for q in s.running if q.num_output and len(q.tokens) - q.num_computed == 1]
        assert set(decoding) <= {it.seq_id for it in plan.items}


def test_the_hard_cap_holds_when_the_target_would_allow_more():
    s = make(max_batch_size=64, prefill_token_budget=32, target_tpot_s=10.0)
    clock = Clock(s)
    for sid in range(1, 20):
        s.add(seq(sid, 100, max_new=4))
    clock.run()
    for plan, rows, _ in clock.plans:
        assert sum(len(it.token_ids) for it in plan.items) - rows <= 32
    assert len(clock.outputs) == 19


def test_under_fcfs_a_target_is_not_overridden_by_waiting():
    """Decode rows alone overrun the target: nobody is admitted while they run (no aging under fcfs:
    admission is in arrival order), the running batch drains, and then the waiting prompt starts."""
    s = make(max_batch_size=64, prefill_token_budget=4096, target_tpot_s=0.005, aging_s=0.5)
    assert not s.policy.ages
    clock = Clock(s)
    for sid in range(1, 11):
        s.add(seq(sid, 8, max_new=60))
    clock.run(until=lambda: len(clock.plans) > 20)
    late = seq(99, 30, max_new=2, arrival=clock.now)
    s.add(late)
    clock.run(until=lambda: 99 in clock.first_token)
    assert all(sid in clock.outputs for sid in range(1, 11))   # it started only once they had finished
    assert clock.first_token[99] - late.arrival > 0.5          # past the aging bound: no override
    clock.run()
    assert clock.outputs[99] == alone(late.prompt_ids, 2)


def test_a_target_below_an_empty_step_still_serves_everyone():
    """A target no step can meet (not even one with no rows): prompts move by the floor, all answered."""
    s = make(max_batch_size=8, prefill_token_budget=4096, target_tpot_s=0.001)
    clock = Clock(s)
    want = {}
    for sid in range(1, 13):
        q = seq(sid, 40, max_new=5)
        want[sid] = alone(q.prompt_ids, 5)
        s.add(q)
    clock.run()
    assert clock.outputs == want
    for plan, rows, _ in clock.plans[MIN_STEPS + 1:]:
        assert sum(len(it.token_ids) for it in plan.items) - rows <= min_prefill_tokens(4096)


def test_aging_bounds_how_long_a_prompt_is_passed_over_under_priority():
    """Priority classes: a low-priority prompt behind a stream of better ones starts once it has
    waited aging_s, and is protected from priority preemption only until its first token."""
    s = make(max_batch_size=2, prefill_token_budget=4096, scheduling_policy="priority", aging_s=0.5)
    clock = Clock(s)
    late = seq(1, 30, max_new=2, priority=9)
    sid = 100
    while 1 not in clock.first_token and clock.now < 5.0:
        while sum(1 for q in s.seqs.values() if q.priority == 0) < 3:
            sid += 1
            s.add(seq(sid, 6, max_new=6, arrival=clock.now, priority=0))
        if clock.now >= 0.01 and 1 not in s.seqs:
            late.arrival = late.waiting_since = clock.now
            s.add(late)
        clock.step()
    waited = clock.first_token[1] - late.arrival
    assert 0.5 <= waited <= 0.5 + 6 * cost(2, 30)       # aged, then admitted within a few steps
    assert not late.aged_in


def test_an_aged_request_that_cannot_get_in_does_not_hold_back_a_better_class():
    """A full batch of low-priority streams and an aged low-priority request waiting at the head of
    the queue (it outranks nobody, so it waits for a slot): a high-priority arrival still preempts
    into the batch at once, and the aged one gets the next free slot; nothing is lost."""
    s = make(max_batch_size=2, scheduling_policy="priority", aging_s=0.3)
    clock = Clock(s)
    for sid in (1, 2):
        s.add(seq(sid, 6, max_new=200, priority=10))
    clock.step()
    aged = seq(3, 6, max_new=3, arrival=clock.now, priority=10)
    s.add(aged)
    clock.run(until=lambda: clock.now - aged.arrival > 0.35)
    assert 3 not in clock.first_token                 # aged, but no room and nobody it outranks
    urgent = seq(9, 5, max_new=2, arrival=clock.now, priority=0)
    s.add(urgent)
    plan = clock.step()
    assert 9 in {i.seq_id for i in plan.items} and plan.preempted == [2]
    clock.run()
    assert set(clock.outputs) == {1, 2, 3, 9}
    # the aged one took the first free slot (the urgent one's, two steps later), not the preempted one
    # (whose 200 tokens hold a slot for over a second)
    assert clock.first_token[3] - urgent.arrival < 0.1


def test_under_a_target_aged_requests_move_by_the_floor_not_the_whole_budget():
    """Decode rows alone fill the target; requests pile up and age. They keep moving (the floor each
    step, the aged first) and the steps stay short: an aged flood does not undo the target."""
    s = make(max_batch_size=64, prefill_token_budget=4096, target_tpot_s=0.02, scheduling_policy="priority",
             aging_s=0.05)
    clock = Clock(s)
    for sid in range(1, 17):                          # 16 x 1 ms decode rows: the target is nearly full
        s.add(seq(sid, 4, max_new=80, priority=5))
    clock.run(until=lambda: len(clock.plans) > MIN_STEPS + 4)
    for sid in range(100, 130):                       # 30 prompts of 300 tokens, they all age
        s.add(seq(sid, 300, max_new=2, arrival=clock.now, priority=5))
    start = len(clock.plans)
    clock.run()
    assert set(clock.outputs) == {*range(1, 17), *range(100, 130)}
    floor = min_prefill_tokens(4096)
    for _, rows, took in clock.plans[start:]:     # within the target, or the floor's step where it is full
        assert took <= max(0.02, cost(rows, floor)) * 1.05


def test_a_better_class_awaiting_prefill_keeps_the_worse_classes_prompts_out_of_the_step():
    s = make(max_batch_size=64, prefill_token_budget=4096, scheduling_policy="priority", aging_s=100.0)
    clock = Clock(s)
    for sid in range(1, 9):                           # a flood of long low-priority prompts
        s.add(seq(sid, 400, max_new=20, priority=10))
    clock.step()                                      # 4096 tokens of them in the first step
    short = seq(50, 12, max_new=2, arrival=clock.now, priority=0)
    s.add(short)
    plan = clock.step()
    ids = {it.seq_id: len(it.token_ids) for it in plan.items}
    assert ids[50] == 12                              # the better class's prompt whole ...
    # ... and the worse ones' prompts at most the floor beside it (4096 tokens a step before)
    assert sum(n for sid, n in ids.items() if sid != 50) <= min_prefill_tokens(4096)
    clock.run()
    assert set(clock.outputs) == {*range(1, 9), 50}   # nothing lost
def test_worse_classes_decode_rows_sit_out_while_a_better_prompt_prefills_a_bounded_number_of_steps():
    """Priority: a better class's prompt prefills in steps without the worse classes' decode rows (its
    first token sooner); a row that sat out SIT_OUT_STEPS steps in a row decodes in the next (none stalls);
    fcfs and equal classes keep every decode row."""
    s = make(max_batch_size=64, prefill_token_budget=16, scheduling_policy="priority", aging_s=100.0)
    clock = Clock(s)
    for sid in range(1, 6):
        s.add(seq(sid, 4, max_new=40, priority=10))
    for _ in range(3):
        clock.step()
    assert all(len(q.tokens) - q.num_computed == 1 for q in s.running)      # all five decoding
    s.add(seq(50, 16 * (SIT_OUT_STEPS + 2), max_new=2, arrival=clock.now, priority=0))  # 16 tokens a step
    steps = [{it.seq_id for it in clock.step().items} for _ in range(SIT_OUT_STEPS + 2)]
    assert steps[:SIT_OUT_STEPS] == [{50}] * SIT_OUT_STEPS      # the better prompt's steps: nothing else
    assert steps[SIT_OUT_STEPS] == {50, *range(1, 6)}           # then the rows that sat out decode one
    assert steps[SIT_OUT_STEPS + 1] == {50}                     # ... and sit out again while it prefills
    clock.run()
    assert set(clock.outputs) == {*range(1, 6), 50}
    assert all(clock.outputs[sid] == alone(seq(sid, 4).prompt_ids, 40) for sid in range(1, 6))
    for policy, pr in (("fcfs", 0), ("priority", 10)):     # fcfs, or the same class: nobody sits out
        s = make(max_batch_size=64, prefill_token_budget=24, scheduling_policy=policy, aging_s=100.0)
        clock = Clock(s)
        for sid in range(1, 6):
            s.add(seq(sid, 4, max_new=30, priority=10))
        for _ in range(3):
            clock.step()
        s.add(seq(50, 60, max_new=2, arrival=clock.now, priority=pr))
        assert {it.seq_id for it in clock.step().items} == {50, *range(1, 6)}


def test_worse_prompts_sit_out_the_steps_a_better_prompt_fills_a_bounded_number_in_a_row():
    """A better prompt larger than the step's budget: the worse classes' prompts (aged ones too) take
    nothing beside it for SIT_OUT_STEPS steps in a row, then move in the next; nothing is lost."""
    s = make(max_batch_size=64, prefill_token_budget=64, scheduling_policy="priority", aging_s=0.01)
    clock = Clock(s)
    for sid in range(1, 4):
        s.add(seq(sid, 100, max_new=4, priority=10))
    clock.step()
    clock.now += 0.05                                 # the flood's prompts have aged
    s.add(seq(50, 64 * (SIT_OUT_STEPS + 2), max_new=2, arrival=clock.now, priority=0))
    worse = []
    for _ in range(SIT_OUT_STEPS + 1):
        ids = {it.seq_id: len(it.token_ids) for it in clock.step().items}
        assert ids.get(50) is not None                # the better prompt moves every step
        worse.append(sum(n for sid, n in ids.items() if sid != 50 and n > 1))
    assert worse[:SIT_OUT_STEPS] == [0] * SIT_OUT_STEPS and worse[SIT_OUT_STEPS] > 0
    clock.run()
    assert set(clock.outputs) == {1, 2, 3, 50}


def test_aged_worse_class_prompts_take_the_floor_beside_a_better_class():
    """The flood's prompts have aged (preempted and waiting): while a short better-class prompt awaits
    its prefill, the aged ones still move but together take at most the floor, so the short one's
    step is not made long by them."""
    s = make(max_batch_size=64, prefill_token_budget=4096, scheduling_policy="priority", aging_s=0.01)
    clock = Clock(s)
    for sid in range(1, 9):
        s.add(seq(sid, 900, max_new=20, priority=10))
    clock.step()                                      # 4096 of their 7200 tokens
    clock.now += 0.05                                 # the rest of them have aged
    assert all(s._aged(q, clock.now) for q in s.running if len(q.tokens) - q.num_computed > 1)
    s.add(seq(50, 12, max_new=2, arrival=clock.now, priority=0))
    plan = clock.step()
    ids = {it.seq_id: len(it.token_ids) for it in plan.items}
    assert ids[50] == 12
    worse = sum(n for sid, n in ids.items() if sid != 50)
    assert worse <= min_prefill_tokens(4096)          # at most the floor beside it ...
    after = {it.seq_id: len(it.token_ids) for it in clock.step().items}
    # ... and moving within SIT_OUT_STEPS + 1 steps (a worse decode row sits out at most that many in a row)
    for _ in range(SIT_OUT_STEPS - 1):
        worse += sum(n for sid, n in after.items() if sid != 50)
        after = {it.seq_id: len(it.token_ids) for it in clock.step().items}
    assert 0 < worse + sum(n for sid, n in after.items() if sid != 50)
    clock.run()
    assert set(clock.outputs) == {*range(1, 9), 50}


def test_without_a_target_or_priority_the_policy_is_unchanged():
    """No target, fcfs: one step prefills everything the budget allows, as before."""
    s = make(max_batch_size=64, prefill_token_budget=4096)
    for sid in range(1, 6):
        s.add(seq(sid, 100))
    plan = s.schedule(0.0)
    assert sum(len(it.token_ids) for it in plan.items) == 500
    assert not s.policy.ages


# ---------------------------------------------------------------- priority
def test_priority_admits_lower_numbers_first():
    s = make(max_batch_size=2, scheduling_policy="priority")
    for sid, pr in ((1, 5), (2, 0), (3, 5), (4, -1)):
        s.add(seq(sid, 4, priority=pr))
    plan = s.schedule(0.0)
    assert sorted(i.seq_id for i in plan.items) == [2, 4]


def test_fcfs_ignores_the_priority_field_order():
    s = make(max_batch_size=2)
    for sid, pr in ((1, 5), (2, 0), (3, -1)):
        s.add(seq(sid, 4, priority=pr))
    assert sorted(i.seq_id for i in s.schedule(0.0).items) == [1, 2]


@pytest.mark.parametrize("strategy", ["paged", "rolling"])
def test_a_higher_priority_arrival_preempts_and_nothing_is_lost(strategy):
    s = make(strategy, max_batch_size=3, scheduling_policy="priority", aging_s=100.0)
    clock = Clock(s)
    want = {}
    for sid in (1, 2, 3):
        q = seq(sid, 6, max_new=30, priority=10)
        want[sid] = alone(q.prompt_ids, 30)
        s.add(q)
    for _ in range(5):
        clock.step()
    urgent = seq(7, 5, max_new=3, arrival=clock.now, priority=0)
    want[7] = alone(urgent.prompt_ids, 3)
    s.add(urgent)
    plan = clock.step()
    assert plan.preempted == [3]                      # the newest of the lowest class
    assert 7 in {i.seq_id for i in plan.items}        # prefilled in the same step
    assert s.preemption_causes == {"kv_cache": 0, "priority": 1}
    clock.run()
    assert clock.outputs == want                      # the victim recomputed: same tokens, all answered


def test_equal_priority_never_preempts():
    s = make(max_batch_size=2, scheduling_policy="priority")
    clock = Clock(s)
    for sid in (1, 2):
        s.add(seq(sid, 4, max_new=20, priority=3))
    clock.step()
    s.add(seq(3, 4, max_new=2, arrival=clock.now, priority=3))
    assert clock.step().preempted == []


def test_kv_shortage_victim_is_the_lowest_class():
    """Blocks run out: the victim is the newest of the highest number, not simply the newest."""
    s = make(num_blocks=12, block_size=4, max_batch_size=8, scheduling_policy="priority", aging_s=100.0)
    clock = Clock(s)
    s.add(seq(1, 8, max_new=20, priority=9))
    s.add(seq(2, 8, max_new=20, priority=0))
    s.add(seq(3, 8, max_new=20, priority=0))
    victims = []
    clock.run(until=lambda: bool(victims.extend(clock.plans[-1][0].preempted) if clock.plans else False)
              or victims)
    assert victims[0] == 1 and s.preemption_causes["kv_cache"] >= 1
    clock.run()
    assert set(clock.outputs) == {1, 2, 3}


def test_a_low_priority_request_does_not_starve_under_a_flood_of_high_ones():
    s = make(max_batch_size=2, scheduling_policy="priority", aging_s=0.3)
    clock = Clock(s)
    low = seq(1, 6, max_new=4, priority=5)
    s.add(low)
    sid = 100
    # High-priority requests keep both slots busy and keep arriving, for 3 s of synthetic time.
    while clock.now < 3.0 and 1 not in clock.outputs:
        while sum(1 for q in s.seqs.values() if q.priority == 0) < 3:
            sid += 1
            s.add(seq(sid, 6, max_new=6, arrival=clock.now, priority=0))
        clock.step()
    assert 1 in clock.outputs and clock.outputs[1] == alone(low.prompt_ids, 4)
    assert clock.first_token[1] <= 0.3 + 0.2            # started within the aging bound (+ a few steps)


def test_policy_rejects_an_unknown_scheduling_policy():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerPolicy("paged", scheduling_policy="lifo")
