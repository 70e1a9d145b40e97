"""Guided decoding through the whole engine (tiny demo model, real xgrammar) under every strategy:
greedy guided answers are the same whatever the strategy and the batch (the parity oracle, with
the grammar's mask), they satisfy their grammar, and a paged run that preempts (recompute) gives
the same tokens; n samples, prefix caching and a stop string work with a grammar."""
from __future__ import annotations

import json
import re

import pytest

from handler.engine.request import SamplingParams, parse_params
from tests.support.engine import PROMPTS, STRATEGIES, assert_drained, make_engine, run_all

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}}},
          "required": ["ok", "n", "tags"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
GUIDES = [{"guided_json": SCHEMA}, {"guided_regex": REGEX}, {"guided_choice": ["alpha", "beta", "gamma"]},
          {}, {"guided_json": SCHEMA}, {"guided_regex": REGEX}]


def params(i, **kw):
    # ignore_eos on the unguided rows: random weights emit EOS at random; the guided rows end at
    # their grammar's end (the matcher terminates) whatever ignore_eos says.
    return parse_params({"max_new_tokens": 60, "ignore_eos": True, **GUIDES[i], **kw})


def check(i, text):
    g = GUIDES[i]
    if "guided_json" in g:
        obj = json.loads(text)
        assert set(obj) == {"ok", "n", "tags"} and obj["n"] in (1, 2, 3) and set(obj["tags"]) <= {"x", "y"}
    elif "guided_regex" in g:
        assert re.fullmatch(REGEX, text), text
    elif "guided_choice" in g:
        assert text in g["guided_choice"]


@pytest.fixture(scope="module")
def reference(demo_model_dir, tmp_path_factory):
    """Each prompt alone on the none strategy."""
    eng = make_engine(demo_model_dir, tmp_path_factory.mktemp("ref"), STRATEGIES["none"])
    try:
        return [run_all(eng, [p], [params(i)])[0] for i, p in enumerate(PROMPTS)]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("strategy", ["dynamic", "rolling", "paged"])
def test_guided_greedy_is_the_same_under_every_strategy(strategy, demo_model_dir, tmp_path, reference):
    eng = make_engine(demo_model_dir, tmp_path, STRATEGIES[strategy])
    try:
        got = run_all(eng, PROMPTS, [params(i) for i in range(len(PROMPTS))])
        assert_drained(eng)
    finally:
        eng.shutdown()
    for i, ((ids, done), (want, want_done)) in enumerate(zip(got, reference)):
        assert ids == want, (strategy, i)
        check(i, done.generated_text)
        if GUIDES[i]:
            assert done.finish_reason == "eos_token", (i, done)


def test_preemption_recompute_keeps_the_matcher(demo_model_dir, tmp_path):
    prompts = [PROMPTS[i % len(PROMPTS)][:60] for i in range(10)]
    plist = [params(i % len(GUIDES), max_new_tokens=36) for i in range(10)]
    (tmp_path / "alone").mkdir()
    (tmp_path / "tight").mkdir()
    alone = make_engine(demo_model_dir, tmp_path / "alone", STRATEGIES["none"])
    try:
        want = [run_all(alone, [p], [q])[0][0] for p, q in zip(prompts, plist)]
    finally:
        alone.shutdown()
    tight = {**STRATEGIES["paged"], "option.kv_cache_tokens": "96", "option.block_size": "4",
             "option.max_rolling_batch_size": "8"}
    eng = make_engine(demo_model_dir, tmp_path / "tight", tight)
    try:
        got = run_all(eng, prompts, plist)
        preempted = eng.scheduler.stats["preemptions"]
    finally:
        eng.shutdown()
    assert preempted > 0
    assert [ids for ids, _ in got] == want


def test_samples_prefix_caching_and_stop_with_a_grammar(demo_model_dir, tmp_path):
    props = {**STRATEGIES["paged"], "option.enable_prefix_caching": "true"}
    eng = make_engine(demo_model_dir, tmp_path, props)
    try:
        p = params(0, n=3, do_sample=True, temperature=1.0, seed=4)
        chans = eng.submit([eng.tokenize(PROMPTS[2])] * 2, p)
        texts = []
        for ch in chans:
            while True:
                ev = ch.events.get(timeout=300)
                if ev.done:
                    texts.append(ev.done.generated_text)
                    break
        for t in texts:
            check(0, t)
        assert eng.blocks.hit_tokens > 0           # the second prompt's blocks came from the cache
        (ids, done), = run_all(eng, [PROMPTS[1]], [SamplingParams(**{
            **params(2).__dict__, "stop_sequences": ("mm",), "include_stop_str_in_output": False})])
        assert done.generated_text in ("alpha", "beta", "ga")
    finally:
        eng.shutdown()
