"""Speculative decoding with a draft model (handler/model/spec_draft.py): a draft equal to the target is
accepted in full, a different draft (same tokenizer, perturbed weights) in part, greedy output equals
`generate` either way, sampled output keeps the target's distribution, the draft's KV is freed on finish
and preemption, and a draft with another tokenizer is refused at start-up in one line."""
from __future__ import annotations

import json
import os
import time

import pytest

from handler.engine.request import SamplingParams
from tests.engine.test_spec import baseline  # noqa: F401 (a fixture)
from tests.engine.test_spec import NEW_TOKENS, N_DRAWS, _sample_outputs, assert_same_distribution
from tests.support.engine import PROMPTS, STRATEGIES, assert_drained, make_engine, run_all
from tests.support.reference import hf_greedy

PARTIAL_SIGMA = 0.01     # weight noise (x each tensor's std) at which the tiny draft agrees in part


@pytest.fixture(scope="module")
def other_draft(demo_model_dir, tmp_path_factory) -> str:
    """The demo model with every weight perturbed: same tokenizer, different (close) predictions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = str(tmp_path_factory.mktemp("draft"))
    m = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * PARTIAL_SIGMA * p.std())
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(demo_model_dir).save_pretrained(out)
    return out


def draft_engine(model_dir, tmp_path, strategy, draft, extra=None, k=4):
    cfg = json.dumps({"method": "draft_model", "num_speculative_tokens": k, "model": draft})
    return make_engine(model_dir, tmp_path, {**STRATEGIES[strategy], "option.kv_cache_tokens": "2048",
                                             "option.speculative_config": cfg, **(extra or {})})


def draft_drained(engine):
    pr = engine.proposer
    for _ in range(100):
        if pr.blocks.num_free == pr.blocks.num_blocks:
            break
        time.sleep(0.02)
    assert pr.blocks.num_free == pr.blocks.num_blocks and not pr.held and not pr.blocks.tables
    pr.blocks.check_invariants()


@pytest.mark.parametrize("strategy", ["rolling", "paged"])
def test_a_draft_model_equal_to_the_target_is_accepted_in_full(strategy, demo_model_dir, tmp_path):
    engine = draft_engine(demo_model_dir, tmp_path, strategy, demo_model_dir)
    try:
        assert engine.proposer.method == "draft_model"
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
        got = run_all(engine, prompts, [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3)
        for p, (ids, done) in zip(prompts, got):
            assert ids == hf_greedy(demo_model_dir, p, 30, ignore_eos=True), p[:30]
            assert done.generated_tokens == 30
        st = engine.stats()["spec"]["draft_model"]
        assert st["proposed"] > 0 and st["accepted"] == st["proposed"], st
        # k=4: after the first token each verify emits 5 tokens (the last one shorter at the end).
        assert st["verifies"] <= 3 * (-(-29 // 5)), st
        assert_drained(engine)
        draft_drained(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy", ["rolling", "paged"])
def test_a_different_draft_is_accepted_in_part_and_greedy_stays_exact(strategy, demo_model_dir, other_draft,
                                                                       tmp_path):
    engine = draft_engine(demo_model_dir, tmp_path, strategy, other_draft)
    try:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2]]
        new = [30, 25, 30, 20]
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new]
        for _ in range(2):      # the second round re-uses the draft's pool: rolled back and freed
            got = run_all(engine, prompts, params)
            for p, n, (ids, _) in zip(prompts, new, got):
                assert ids == hf_greedy(demo_model_dir, p, n, ignore_eos=True), p[:30]
            assert_drained(engine)
            draft_drained(engine)
        st = engine.stats()["spec"]["draft_model"]
        assert 0 < st["accepted"] < st["proposed"], st
    finally:
        engine.shutdown()


def test_preemption_and_penalties_free_the_draft_kv(demo_model_dir, other_draft, tmp_path):
    """A tight paged pool: preempted sequences' draft KV is freed (and caught up again on their
    next proposal); repetition penalty over the draft's positions; the draft pool ends empty."""
    engine = draft_engine(demo_model_dir, tmp_path, "paged", other_draft,
                          {"option.kv_cache_tokens": "160", "option.block_size": "8",
                           "option.max_rolling_batch_size": "4"})
    try:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2]]
        params = [SamplingParams(max_new_tokens=n, repetition_penalty=1.3 if i % 2 else 1.0)
                  for i, n in enumerate([40, 33, 27, 45])]
        released = []
        pr = engine.proposer
        orig = pr.release
        pr.release = lambda sid: (released.append(sid), orig(sid))
        got = run_all(engine, prompts, params)
        for p, prm, (ids, _) in zip(prompts, params, got):
            assert ids == hf_greedy(demo_model_dir, p, prm.max_new_tokens, prm.repetition_penalty), p[:30]
        assert engine.stats()["preemptions"] > 0
        assert len(released) > len(prompts)     # every finish, and the preemptions
        assert engine.stats()["spec"]["draft_model"]["accepted"] > 0
        assert_drained(engine)
        draft_drained(engine)
    finally:
        engine.shutdown()


def test_sampled_output_distribution_with_a_draft_model_is_the_targets(demo_model_dir, other_draft, tmp_path,
                                                                       baseline):  # noqa: F811
    """The draft's proposal is its greedy token, a point mass q: spec_verify's rule (accept d with
    p(d), else draw from p without d) is exact for it. Position by position chi-square p > 0.001
    against the same baseline as prompt lookup's test (tests/engine/test_spec.py). A wrong rule fails
    it: drawing a rejected position's token from p instead of p without d gave p = 1.6e-34."""
    ids, base = baseline
    engine = draft_engine(demo_model_dir, tmp_path, "paged", other_draft,
                          {"option.max_rolling_batch_size": "64", "option.kv_cache_tokens": "8192"})
    try:
        spec = _sample_outputs(engine, ids, N_DRAWS, 90_000, NEW_TOKENS)
        st = engine.stats()["spec"]["draft_model"]
        draft_drained(engine)
    finally:
        engine.shutdown()
    assert_same_distribution(base, spec, st)


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(demo_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from handler.model.runner import ModelLoadError
    bad = tmp_path / "bad-draft"
    bad.mkdir()
    for name in os.listdir(demo_model_dir):
        if not name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens")):
            os.symlink(os.path.join(demo_model_dir, name), bad / name)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    tok.add_tokens(["<an-extra-token>"])
    tok.save_pretrained(str(bad))
    with pytest.raises(ModelLoadError) as e:
        draft_engine(demo_model_dir, tmp_path, "rolling", str(bad))
    msg = str(e.value)
    assert "option.speculative_draft_model" in msg and "tokenizer" in msg and "\n" not in msg, msg


def test_a_missing_or_s3_draft_is_refused_at_config(demo_model_dir, tmp_path):
    from handler.config import ConfigError, load_config
    for value, words in [(str(tmp_path / "nope"), "does not exist"), ("s3://bucket/draft", "s3://")]:
        path = tmp_path / "serving.properties"
        path.write_text(f"option.rolling_batch=auto\noption.speculative_draft_model={value}\n")
        with pytest.raises(ConfigError) as e:
            load_config(str(path), demo_model_dir, env={})
        msg = str(e.value)
        assert words in msg and "option.speculative_draft_model" in msg and "\n" not in msg, msg
    path.write_text(f"option.rolling_batch=auto\noption.speculative_draft_model={demo_model_dir}\n"
                    "option.speculative_length=3\n")
    spec = load_config(str(path), demo_model_dir, env={}).speculative
    assert (spec.method, spec.k, spec.draft_model) == ("draft_model", 3, demo_model_dir)


def test_a_failing_draft_step_costs_only_its_proposals(demo_model_dir, tmp_path):
    engine = draft_engine(demo_model_dir, tmp_path, "rolling", demo_model_dir)
    try:
        pr = engine.proposer
        calls = []
        real_step = pr.runner.step

        def flaky(items, copies=()):
            calls.append(len(items))
            if len(calls) % 3 == 0:
                raise RuntimeError("draft broke")
            return real_step(items, copies)
        pr.runner.step = flaky
        prompts = [PROMPTS[0], PROMPTS[3]]
        got = run_all(engine, prompts, [SamplingParams(max_new_tokens=24, ignore_eos=True)] * 2)
        for p, (ids, _) in zip(prompts, got):
            assert ids == hf_greedy(demo_model_dir, p, 24, ignore_eos=True), p[:30]
        assert len(calls) >= 3 and engine.stats()["spec"]["draft_model"]["accepted"] > 0
        assert_drained(engine)
        draft_drained(engine)
    finally:
        engine.shutdown()
