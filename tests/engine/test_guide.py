"""Guided-decoding requests without a grammar engine: GuideSpec checks (a 400 naming the field),
the parameter table's guided_* / structured_outputs / TGI grammar, and the scheduler advancing each
sequence's matcher with the tokens it accepts, across a preemption. No torch."""
from __future__ import annotations

import json

import pytest

from handler.engine import guide
from handler.engine.blocks import BlockManager
from handler.engine.request import RequestError, SamplingParams, parse_params
from handler.engine.scheduler import Scheduler, SchedulerPolicy, Sequence
from handler.engine.types import Finish, SampleResult


def test_schema_key_order_is_kept_and_specs_hash_by_content():
    a = guide.json_schema("f", {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}})
    assert list(json.loads(a.value)["properties"]) == ["z", "a"]       # generated in this order
    b = guide.json_schema("other.field", json.dumps(json.loads(a.value)))
    assert a == b and hash(a) == hash(b) and a.field != b.field        # one cache entry


@pytest.mark.parametrize("schema,field,words", [
    ({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}},
     "s.properties.x", ["uniqueItems", "not supported"]),
    ({"type": "object", "not": {"type": "string"}}, "s", ['"not"', "not supported"]),
    ({"anyOf": [{"type": "string"}, {"if": {}}]}, "s.anyOf[1]", ['"if"']),
    ({"type": "object", "required": "name"}, "s.required", ["not a valid JSON schema"]),
    ({"type": 5}, "s.type", ["not a valid JSON schema"]),
    ("{not json", "s", ["not valid JSON"]),
    ([1, 2], "s", ["must be a JSON schema"]),
])
def test_bad_schemas_name_the_field(schema, field, words):
    with pytest.raises(RequestError) as e:
        guide.json_schema("s", schema)
    assert e.value.field == field and all(w in e.value.message for w in words), e.value


def test_regex_choice_grammar_checks():
    assert guide.regex("r", r"\d+").value == r"\d+"
    for bad, fn in [("(abc", guide.regex), ("", guide.regex), ([], guide.choice), (["a", 3], guide.choice),
                    ("", guide.grammar)]:
        with pytest.raises(RequestError) as e:
            fn("f", bad)
        assert e.value.field == "f"


def test_parameters_table_parses_every_surface():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = {
        "guided_json": (schema, "json_schema"), "guided_regex": ("[ab]+", "regex"),
        "guided_choice": (["x", "y"], "choice"), "guided_grammar": ('root ::= "a"', "grammar"),
        "structured_outputs": ({"json": schema, "backend": "xgrammar"}, "json_schema"),
        "grammar": ({"type": "json", "value": schema}, "json_schema"),
    }
    for name, (value, kind) in cases.items():
        p = parse_params({name: value})
        assert p.guide.kind == kind and p.guide.field.startswith(f"parameters.{name}")
    assert parse_params({"grammar": {"type": "regex", "value": "a+"}}).guide.value == "a+"
    assert parse_params({"grammar": {"type": "json", "value": {}}}).guide.kind == "json_object"
    assert parse_params({"grammar": None, "guided_decoding_backend": "xgrammar"}).guide is None


@pytest.mark.parametrize("params,field", [
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "parameters.guided_regex"),
    ({"grammar": {"type": "xml", "value": "x"}}, "parameters.grammar.type"),
    ({"grammar": {"type": "regex", "value": "(a"}}, "parameters.grammar.value"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "parameters.structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "parameters.structured_outputs.jsn"),
    ({"logit_bias": {"x": 1}}, "parameters.logit_bias"),
])
def test_parameter_errors_name_the_field(params, field):
    with pytest.raises(RequestError) as e:
        parse_params(params)
    assert e.value.field == field


class RecordingGuide:
    """A GuideState that allows `allowed` tokens and terminates after `stop`."""

    def __init__(self, allowed=None, stop=None):
        self.accepted, self.allowed, self.stop = [], allowed, stop

    def accept(self, token):
        if self.allowed is not None and token not in self.allowed:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self):
        return self.stop is not None and self.stop in self.accepted


def _step(sched, tokens):
    plan = sched.schedule(0.0)
    results = [SampleResult(tokens.get(it.seq_id) if it.sample else None) for it in plan.items]
    return plan, sched.update(plan, results)


def test_the_scheduler_advances_each_matcher_and_keeps_it_across_preemption():
    sched = Scheduler(SchedulerPolicy("paged", eos_token_ids=frozenset({0})), BlockManager(32, 4))
    g1, g2 = RecordingGuide(), RecordingGuide()
    a = Sequence(1, [5, 6, 7], SamplingParams(max_new_tokens=8), 0.0, guide=g1)
    b = Sequence(2, [8, 9], SamplingParams(max_new_tokens=8), 0.0, guide=g2)
    sched.add(a)
    sched.add(b)
    plan, _ = _step(sched, {1: 11, 2: 21})
    assert [it.guide for it in plan.items] == [g1, g2]           # the sampler sees each sequence's own
    _step(sched, {1: 12, 2: 22})
    assert g1.accepted == [11, 12] and g2.accepted == [21, 22]
    sched._preempt(b)                                            # recompute: tokens kept, matcher too
    plan, _ = _step(sched, {1: 13, 2: 23})
    assert b.num_computed == len(b.tokens) - 1 and g2.accepted == [21, 22, 23]
    assert a.tokens[3:] == g1.accepted


def test_a_terminated_matcher_ends_the_sequence_and_a_rejected_token_fails_it():
    sched = Scheduler(SchedulerPolicy("paged", eos_token_ids=frozenset({0})), BlockManager(32, 4))
    done = Sequence(1, [5, 6], SamplingParams(max_new_tokens=8, ignore_eos=True), 0.0,
                    guide=RecordingGuide(stop=3))
    bad = Sequence(2, [5, 7], SamplingParams(max_new_tokens=8), 0.0, guide=RecordingGuide(allowed={1}))
    sched.add(done)
    sched.add(bad)
    _, got = _step(sched, {1: 3, 2: 2})
    assert done.finish_reason == Finish.EOS
    assert bad.finish_reason == Finish.FAILED
    (res,) = [r for s, r in got if s is bad]
    assert res.error[0] == 500 and "rejected" in res.error[1]
