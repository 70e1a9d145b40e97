"""Speculative decoding's Proposer (handler/engine/types.py): both proposers implement it, the scheduler
holds none (it receives token ids), the engine asks it between steps inside the step watchdog's view,
and Engine.step() is the loop's one iteration, returning its outputs."""
from __future__ import annotations

import ast
import inspect
import threading
import time
from pathlib import Path

from handler.config.speculative import SpecConfig
from handler.engine import scheduler as scheduler_module
from handler.engine.loop import Engine
from handler.engine.request import SamplingParams
from handler.engine.scheduler import SchedulerPolicy
from handler.engine.spec import NgramProposer, PerSequence
from handler.engine.types import Proposer
from tests.support.fakes import FakeRunner

SPEC = SpecConfig("ngram", 3, 1, 3, None, None)


def test_both_proposers_implement_the_protocol():
    from handler.model.spec_draft import DraftProposer
    assert isinstance(NgramProposer(), Proposer)
    members = {k for k in vars(Proposer) if not k.startswith("_")} | set(Proposer.__annotations__)
    assert members == {"method", "propose", "release", "reset"}
    for name in members:
        assert hasattr(DraftProposer, name), name
    assert NgramProposer(1, 3).propose([(7, [1, 2, 3, 9, 1, 2, 3], 2), (8, [4, 5], 2)]) == [[9, 1], []]


def test_the_scheduler_holds_no_proposer_and_calls_none():
    """The scheduler names the sequences to draft for and takes ids; nothing in it proposes."""
    tree = ast.parse(Path(inspect.getfile(scheduler_module)).read_text())
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "propose" not in called and "proposer" not in names
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not imported & {"NgramProposer", "proposer", "DraftProposer"}


class Digits:
    """A tokenizer for the output thread: token i is the text "<i>"."""
    all_special_ids: list[int] = []

    def decode(self, ids, **kw):
        return "".join(f"<{i}>" for i in ids)


def _engine(proposer=None, spec=SPEC, step_timeout_s=None):
    policy = SchedulerPolicy("paged", max_batch_size=4, prefill_token_budget=64, spec=spec)
    return Engine(FakeRunner(4, num_blocks=64, tokenizer=Digits()), policy, 4, step_timeout_s=step_timeout_s,
                  proposer=proposer)


def test_a_hanging_proposer_is_seen_by_the_step_watchdog():
    """A draft model's forwards run in the engine thread between steps: one that never returns
    turns the engine unhealthy with the step timeout's reason, as a wedged model step does."""
    gate = threading.Event()

    class Hangs(PerSequence):
        def draft(self, tokens, k):
            gate.wait(30)
            return []
    engine = _engine(Hangs(), step_timeout_s=0.3).start()
    try:
        engine.submit([[1, 2, 3, 1, 2]], SamplingParams(max_new_tokens=8, ignore_eos=True))
        deadline = time.monotonic() + 20
        while engine.check_health() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.healthy and "engine_step_timeout=0.3" in engine.error, engine.error
    finally:
        gate.set()
        engine.shutdown()


def test_step_is_one_iteration_and_returns_its_outputs():
    asked = []

    class Records(PerSequence):
        def propose(self, asks):
            asked.append([(sid, k) for sid, _, k in asks])
            return [[] for _ in asks]       # no drafts: the fake runner verifies none
    engine = _engine(Records()).run_by_hand()
    (chan,) = engine.submit([[1, 2, 3, 1, 2]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    first = engine.step()               # the prompt: one token out
    assert [o.token is not None for o in first] == [True] and asked == []
    second = engine.step()              # a decode step: the proposer was asked for it first
    assert len(second) == 1 and asked == [[(first[0].seq_id, 1)]]     # k bounded by max_new_tokens
    third = engine.step()
    assert third[0].finish == "length"
    got = [chan.events.get(timeout=5) for _ in range(3)]
    assert [e.id for e in got] == [o.token for o in first + second + third] and got[-1].done
    assert engine.step() == []          # nothing left to do (it waits for work at most 1 s)
