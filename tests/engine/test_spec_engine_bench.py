"""benchmarks/spec_decode_engine.py: the arms over one runner, alternating per round; an arm whose
speculation never switches on runs the plain arm's plan (equal digests), and the digest tells a plan
with drafts apart."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import spec_decode, spec_decode_engine  # noqa: E402
from handler.engine.request import SamplingParams  # noqa: E402
from handler.engine.spec import PerSequence  # noqa: E402
from tests.support.engine import STRATEGIES, make_engine  # noqa: E402


def test_rounds_alternate_and_a_never_enabled_arm_runs_the_plain_plan(demo_model_dir, tmp_path):
    out = tmp_path / "ab.json"
    assert spec_decode_engine.main(["--model", demo_model_dir, "--workload", "chat", "--clients", "3",
                                    "--requests", "5", "--rounds", "2", "--max-new-tokens", "6",
                                    "--disable-by-batch-size", "1,2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["kv_blocks"]) == {"off", "on@1", "on@2"} and len(set(data["kv_blocks"].values())) == 1
    assert {n: set(d) for n, d in data["config_diff"].items()} == {"on@1": {"speculative_config"},
                                                                  "on@2": {"speculative_config"}}
    runs = data["runs"]
    for rnd in (0, 1):
        order = [r["arm"] for r in runs if r["round"] == rnd]
        assert order == spec_decode.arm_order(["off", "on@1", "on@2"], rnd)
        by = {r["arm"]: r for r in runs if r["round"] == rnd}
        assert by["on@1"]["plan_digest"] == by["off"]["plan_digest"]       # 1 running already disables it
        assert by["on@1"]["proposed"] == 0 and by["on@1"]["steps"] == by["off"]["steps"]
        for r in by.values():
            assert r["requests"] == 5 and 0 < r["output_tokens"] <= 5 * 6
            assert r["wall_s"] >= r["model_s"] > 0


def test_the_plan_digest_differs_when_drafts_are_handed_to_the_runner(demo_model_dir, tmp_path):
    props = {**STRATEGIES["paged"], "option.kv_cache_tokens": "1024"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    off = make_engine(demo_model_dir, tmp_path / "a", props).run_by_hand()
    on = make_engine(demo_model_dir, tmp_path / "b", {**props, "option.speculative_config":
                                                      '{"method": "ngram", "num_speculative_tokens": 3}'}).run_by_hand()
    try:
        class Always(PerSequence):
            method = "ngram"

            def draft(self, tokens, k):
                return [tokens[-1]] * k
        on.proposer = Always()
        reqs = [(off.tokenize(p), SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in ("x = 1", "while True:")]
        a = spec_decode_engine.closed_loop(off, reqs, 2)
        b = spec_decode_engine.closed_loop(on, reqs, 2)
        assert a["proposed"] == 0 and b["proposed"] > 0
        assert a["plan_digest"] != b["plan_digest"]
        assert spec_decode_engine.closed_loop(off, reqs, 2)["plan_digest"] == a["plan_digest"]   # repeatable
    finally:
        off.shutdown()
        on.shutdown()
