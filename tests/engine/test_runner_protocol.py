"""The Runner Protocol (handler/engine/types.py) is exactly what the Engine uses of its runner,
and the tests' one fake runner satisfies it. The real ModelRunner: tests/model/test_runner_protocol.py."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import handler.engine.loop as loop
from handler.engine.request import SamplingParams
from handler.engine.types import KVPool, Runner, SampleResult, SamplerState, StepItem
from tests.support.fakes import FakeRunner


def protocol_members(proto) -> set[str]:
    return {k for k in vars(proto) if not k.startswith("_")}


def engine_uses() -> dict[str, set[str]]:
    """Attribute paths the engine reads off its runner: {"kv": {"num_blocks"}, "step": set(), ...}."""
    tree = ast.parse(Path(inspect.getfile(loop)).read_text())
    used: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value       # runner.X (the __init__ argument) or self.runner.X
        if (isinstance(base, ast.Name) and base.id == "runner") or \
                (isinstance(base, ast.Attribute) and base.attr == "runner"
                 and isinstance(base.value, ast.Name) and base.value.id == "self"):
            used.setdefault(node.attr, set())
    for node in ast.walk(tree):     # one level deeper: runner.kv.num_blocks, runner.sampler.reset
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in used and ast.unparse(node.value.value) in ("runner", "self.runner"):
            used[node.value.attr].add(node.attr)
    return used


def test_the_protocol_is_exactly_what_the_engine_uses():
    used = engine_uses()
    assert set(used) == protocol_members(Runner) == {"tokenizer", "kv", "sampler", "step", "release"}
    assert used["kv"] == protocol_members(KVPool)
    assert used["sampler"] == protocol_members(SamplerState)


def test_the_fake_runner_satisfies_the_protocol():
    r = FakeRunner(4, num_blocks=8)
    assert isinstance(r, Runner) and isinstance(r.kv, KVPool) and isinstance(r.sampler, SamplerState)
    item = StepItem(1, [5, 6], 0, [3], True, SamplingParams(), [5, 6])
    (res,) = r.step([item], [])
    assert isinstance(res, SampleResult) and isinstance(res.token, int)
