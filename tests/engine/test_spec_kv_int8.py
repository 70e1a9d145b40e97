"""Speculative decoding over an int8 KV cache: a rejected position's int8 bytes and scale are
overwritten by the next write, so partly wrong drafts give exactly what the same int8-cache engine
decodes without speculation (prefix caching on, two rounds over the cached prefixes)."""
from __future__ import annotations

from handler.engine.request import SamplingParams
from tests.engine.test_spec import Oracle, spec_engine
from tests.support.engine import PROMPTS, STRATEGIES, assert_drained, make_engine, run_all

INT8 = {"option.kv_cache_dtype": "int8", "option.kv_cache_tokens": "2048", "option.block_size": "4",
        "option.enable_prefix_caching": "true"}


def test_partly_wrong_drafts_over_an_int8_cache_equal_plain_int8_decoding(demo_model_dir, tmp_path):
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3
    (tmp_path / "plain").mkdir()
    plain = make_engine(demo_model_dir, tmp_path / "plain", {**STRATEGIES["paged"], **INT8})
    try:
        want = [ids for ids, _ in run_all(plain, prompts, params)]
        cont = {tuple(plain.tokenize(p)): w for p, w in zip(prompts, want)}
    finally:
        plain.shutdown()
    engine = spec_engine(demo_model_dir, tmp_path, "paged", INT8)
    try:
        engine.proposer = Oracle(cont, wrong=True)
        for _ in range(2):
            assert [ids for ids, _ in run_all(engine, prompts, params)] == want
            assert_drained(engine)
        assert engine.stats()["prefix_cache_hit_tokens"] > 0
        st = engine.stats()["spec"]["ngram"]
        assert 0 < st["accepted"] < st["proposed"]
    finally:
        engine.shutdown()
