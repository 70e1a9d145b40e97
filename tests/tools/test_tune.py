"""`config --explain` arithmetic against hand-derived values and the runner's real KV pool;
the tuner's pieces (objective, early stop, traffic files, prefix sharing) against independent
oracles; and (slow) `tune --preset smoke` end to end: the files and the rule "fastest
candidate that meets the objective", and the nothing-meets exit."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from fractions import Fraction

import pytest

from handler.config import explain
from handler.tools import tune
from handler.tools.bench.metrics import Record, percentile
from handler.config import load_config, parse_properties

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------ explain
def model_dir_with(tmp_path, **cfg) -> str:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


LLAMA = dict(model_type="llama", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             hidden_size=256, max_position_embeddings=1024)


def explained(tmp_path, props: str, cfg=LLAMA, **kw) -> dict:
    md = model_dir_with(tmp_path, **cfg)
    p = tmp_path / "s.properties"
    p.write_text(props)
    c = load_config(str(p), md, check_model=False, env={})
    return explain.explain(c, explain.read_geometry(md), device=kw.pop("device", "cpu"), model_dir=md, **kw)


def test_kv_bytes_per_token_by_hand(tmp_path):
    # 2 (K, V) * layers * kv heads * head dim (hidden / heads) * dtype bytes
    assert explained(tmp_path, "")["kv_bytes_per_token"] == 2 * 4 * 4 * (256 // 8) * 4   # fp32 on CPU
    assert explained(tmp_path, "option.dtype=bf16\n")["kv_bytes_per_token"] == 2 * 4 * 4 * 32 * 2
    # GPT-2 names, no kv heads (= heads); an explicit head_dim wins over hidden / heads
    gpt2 = dict(model_type="gpt2", n_layer=3, n_head=6, n_embd=192, n_positions=512)
    assert explained(tmp_path, "", gpt2)["kv_bytes_per_token"] == 2 * 3 * 6 * 32 * 4
    qwen = dict(LLAMA, num_key_value_heads=2, head_dim=64)
    assert explained(tmp_path, "", qwen)["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4
    # auto dtype on a GPU is bf16 (the runner's rule)
    assert explained(tmp_path, "", device="cuda", gpu_memory_gib=1)["kv_bytes_per_token"] == 2 * 4 * 4 * 32 * 2


def test_pool_and_sequences_at_full_length_by_hand(tmp_path):
    e = explained(tmp_path, "option.rolling_batch=auto\noption.kv_cache_tokens=1000\noption.max_model_len=256\n")
    assert (e["num_blocks"], e["kv_cache_tokens"]) == (63, 1008)          # ceil(1000 / 16) blocks of 16
    assert e["sequences_at_full_length"] == 63 // (256 // 16)             # 3
    assert e["kv_cache_bytes"] == 1008 * 4096
    assert any("rounded up" in n for n in e["notes"])
    # no kv_cache_tokens on a CPU: the runner's default, width x max_model_len
    e = explained(tmp_path, "option.rolling_batch=auto\noption.max_rolling_batch_size=8\n")
    assert e["kv_cache_tokens"] == 8 * 1024 and e["sequences_at_full_length"] == 8


def test_mix_waste_and_paged_demand_by_hand(tmp_path):
    # P=20, M=64, outputs 8/16/32, blocks of 16, pool of 63 blocks.
    e = explained(tmp_path, "option.rolling_batch=auto\noption.paged_attention=false\n"
                            "option.max_rolling_batch_size=64\noption.kv_cache_tokens=1000\n",
                  prompt_tokens=20, output_lengths=[8, 16, 32], max_new_tokens=64)
    m = e["mix"]
    assert m["reserved_tokens_per_sequence"] == 96                        # ceil(84 / 16) * 16
    assert m["sequences_at_prompt_plus_max_new_tokens"] == 63 // 6        # 10
    mean_l = Fraction(8 + 16 + 32, 3)
    assert m["reservation_waste_at_end"] == pytest.approx(float(1 - (20 + mean_l) / 96))
    # written slot-steps over a life: sum_{t=1..L} (20 + t) = 20 L + L (L + 1) / 2 -> 196, 456, 1168
    assert m["reservation_waste_over_life"] == pytest.approx(float(1 - Fraction(196 + 456 + 1168, 3) / (96 * mean_l)))
    # paged blocks over a life: L=8: 8 x 2; L=16: 12 x 2 + 4 x 3; L=32: 12 x 2 + 16 x 3 + 4 x 4
    per_seq = Fraction(16 + 36 + 88, 3) / mean_l
    assert m["paged_mean_blocks_per_sequence"] == pytest.approx(float(per_seq))     # 2.5
    assert m["paged_sequences_in_steady_state"] == pytest.approx(float(63 / per_seq))
    assert any("max_rolling_batch_size=64 cannot help above 10" in w for w in e["warnings"]), e["warnings"]
    assert any("prefill_tokens=4096 cannot help" in w for w in e["warnings"])

    p = explained(tmp_path, "option.rolling_batch=auto\noption.max_rolling_batch_size=30\noption.kv_cache_tokens=1000\n",
                  prompt_tokens=20, output_lengths=[8, 16, 32], max_new_tokens=64)["mix"]
    assert p["paged_steady_state_demand"] == pytest.approx(float(30 * per_seq / 63))  # 75 / 63
    assert p["paged_worst_case_demand"] == pytest.approx(30 * 6 / 63)
    assert p["preemption"].startswith("expected")
    q = explained(tmp_path, "option.rolling_batch=auto\noption.max_rolling_batch_size=64\noption.kv_cache_tokens=1000\n",
                  prompt_tokens=20, output_lengths=[8], max_new_tokens=64)
    # 64 running cannot fit even at the first token: 63 // ceil(21 / 16) = 31
    assert any("cannot help: the KV cache holds 31 sequences" in w for w in q["warnings"]), q["warnings"]
    ok = explained(tmp_path, "option.rolling_batch=auto\noption.max_rolling_batch_size=4\noption.kv_cache_tokens=1000\n"
                             "option.max_model_len=512\noption.max_rolling_batch_prefill_tokens=512\n",
                   prompt_tokens=20, output_lengths=[8], max_new_tokens=64)
    assert ok["warnings"] == [] and ok["mix"]["preemption"].startswith("none")


def test_dynamic_steps_by_hand(tmp_path):
    # batches of 2 from lengths {1, 3}: E[max] = 1 * 1/4 + 3 * 3/4 = 2.5 steps for E[L] = 2 tokens each
    e = explained(tmp_path, "batch_size=2\noption.kv_cache_tokens=512\n", prompt_tokens=4, output_lengths=[1, 3])
    assert e["strategy"] == "dynamic"
    assert e["mix"]["dynamic_steps_over_iteration_level"] == pytest.approx(2.5 / 2)


def test_explain_states_the_latency_policy(tmp_path):
    e = explained(tmp_path, "option.rolling_batch=auto\noption.kv_cache_tokens=512\noption.target_tpot_ms=75\n"
                            "option.scheduling_policy=priority\n")
    assert e["scheduling"] == {"policy": "priority", "target_tpot_ms": 75.0, "aging_ms": 2000.0,
                               "prefill_cap_tokens": 4096}
    notes = " ".join(e["notes"])
    assert "option.target_tpot_ms=75" in notes and "option.scheduling_policy=priority" in notes
    assert "scheduling" not in explained(tmp_path, "option.rolling_batch=auto\noption.kv_cache_tokens=512\n")


def test_explain_matches_the_runners_kv_pool(demo_model_dir, tmp_path):
    """The oracle: the tensors the runner allocates, and its default sizing."""
    from handler.model.runner import ModelRunner

    r = ModelRunner(demo_model_dir, device="cpu", block_size=16, max_running=3, max_model_len=200)
    allocated = sum(t.numel() * t.element_size() for k, v in r.kv_cache for t in (k.data, v.data))
    (tmp_path / "p").write_text("option.rolling_batch=auto\noption.max_rolling_batch_size=3\noption.max_model_len=200\n")
    cfg = load_config(str(tmp_path / "p"), demo_model_dir, env={})
    e = explain.explain(cfg, explain.read_geometry(demo_model_dir), device="cpu")
    assert e["kv_cache_tokens"] == r.kv.tokens
    assert e["kv_bytes_per_token"] * e["kv_cache_tokens"] == allocated


def test_geometry_matches_transformers_configs(tmp_path):
    from transformers import AutoConfig

    from handler.tools.demo_model import FAMILIES, model_config
    from handler.model.runner import model_geometry

    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 3
    for fam in FAMILIES:
        d = tmp_path / fam
        model_config(fam, Tok()).save_pretrained(d)
        g = explain.read_geometry(str(d))
        assert (g.layers, g.kv_heads, g.head_dim, g.max_positions) == model_geometry(AutoConfig.from_pretrained(d)), fam


def test_config_explain_command_line(demo_model_dir, tmp_path):
    (tmp_path / "p").write_text("option.rolling_batch=auto\noption.kv_cache_tokens=320\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "handler", "config", "--explain", "--properties",  # noqa: E731
                                     str(tmp_path / "p"), "--model-dir", demo_model_dir, *a],
                                    cwd=ROOT, capture_output=True, text=True, timeout=120)
    r = run("--json", "--prompt-tokens", "10", "--output-lengths", "4,12")
    assert r.returncode == 0, r.stderr
    e = json.loads(r.stdout)
    assert e["kv_bytes_per_token"] == 4096 and e["num_blocks"] == 20 and e["mix"]["max_new_tokens"] == 12
    r = run()
    assert r.returncode == 0 and "KV bytes per token: 4096 = 2 * 4 layers * 4 kv heads * 32 head dim * 4 bytes" in r.stdout
    r = run("--output-lengths", "4,x")
    assert r.returncode == 2 and "--output-lengths='4,x'" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------ tuner pieces
def test_parse_slo():
    assert tune.parse_slo("ttft_p90_ms=500,tpot_p90_ms=50,latency_p90_s=2.5") == {
        "ttft_p90_ms": 500.0, "tpot_p90_ms": 50.0, "latency_p90_s": 2.5}
    for bad, msg in (("ttft_p99_ms=5", "unknown target 'ttft_p99_ms'"), ("latency_p90_s=-1", "not a positive"),
                     ("latency_p90_s", "not a positive"), ("tpot_p90_ms=abc", "not a positive")):
        with pytest.raises(tune.UsageError, match=msg):
            tune.parse_slo(bad)


def test_p90_early_stop_bound_agrees_with_the_percentile():
    """Whenever the bound says 'must miss', the bench's percentile does miss, whatever the
    unknown values are; with one fewer known-over value, some completion meets the target."""
    rng = random.Random(1)
    for n in range(1, 40):
        need = next(k for k in range(n + 1) if tune.p90_must_exceed(k, n))
        for _ in range(20):
            # `need` values over the target 1.0, the rest anything (here: worst case, below)
            vals = [1.0 + rng.random() for _ in range(need)] + [rng.random() for _ in range(n - need)]
            assert percentile(vals, 90) > 1.0
        if need > 0:
            vals = [1.0 + 1e-6] * (need - 1) + [0.0] * (n - need + 1)
            assert percentile(vals, 90) <= 1.0, (n, need)


def test_decide_picks_the_fastest_that_meets():
    rows = [dict(requests_per_s=5.0, meets_slo=True, complete=True, latency_p90_s=1.0),
            dict(requests_per_s=9.0, meets_slo=False, complete=True, latency_p90_s=3.0),
            dict(requests_per_s=7.0, meets_slo=True, complete=True, latency_p90_s=1.9),
            dict(requests_per_s=None, meets_slo=False, stopped="not measured")]
    assert tune.decide(rows, {"latency_p90_s": 2.0}) == (2, None)
    for r in rows:
        r["meets_slo"] = False
    # none meets: the closest complete one (worst ratio to its target)
    assert tune.decide(rows, {"latency_p90_s": 0.5}) == (None, 0)


def test_decide_prefers_goodput_under_a_ttft_tpot_objective():
    rows = [dict(requests_per_s=9.0, goodput_per_s=4.0, meets_slo=True, complete=True, tpot_p90_ms=48.0),
            dict(requests_per_s=7.0, goodput_per_s=6.5, meets_slo=True, complete=True, tpot_p90_ms=30.0),
            dict(requests_per_s=9.5, goodput_per_s=7.0, meets_slo=False, complete=True, tpot_p90_ms=70.0)]
    assert tune.decide(rows, {"tpot_p90_ms": 50.0}) == (1, None)
    assert tune.goodput_slo({"tpot_p90_ms": 50.0, "latency_p90_s": 2.0}) == tune.Slo(None, 0.05)
    assert tune.goodput_slo({"latency_p90_s": 2.0}) is None


def test_a_tpot_objective_proposes_a_target_tpot_candidate(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    tr = tune.traffic_from_workload(tune.preset_workload("lmi", "cpu"), tok)
    base = load_config(None, demo_model_dir, env={})
    cands = tune.propose(tr, base, explain.read_geometry(demo_model_dir), {"tpot_p90_ms": 50.0}, 8, tok)
    targeted = [c for c in cands if "option.target_tpot_ms" in c.properties]
    assert [c.properties["option.target_tpot_ms"] for c in targeted] == ["40"] and "40 ms" in targeted[0].reason
    none = tune.propose(tr, base, explain.read_geometry(demo_model_dir), {"latency_p90_s": 2.0}, 8, tok)
    assert not any("option.target_tpot_ms" in c.properties for c in none)


def test_watch_stops_a_hopeless_candidate():
    w = tune.Watch(10, {"latency_p90_s": 0.5}, None, time.monotonic() + 60)
    w.on_start(0, 0.0)
    w.on_done(0, Record(start=0, end=1.0, tokens=3, ttft=0.1))
    assert not w.stop.is_set()                 # 1 of 10 over: the p90 can still meet
    w.on_start(1, 0.0)
    w.started[1] -= 1.0                       # in flight for a second already
    w.check()
    assert w.stop.is_set() and "latency p90 must miss" in w.reason
    w = tune.Watch(10, {}, 0.01, time.monotonic() + 60)
    w.on_start(0, 0.0)
    time.sleep(0.02)
    w.check()
    assert "slower than the best" in w.reason
    w = tune.Watch(10, {}, None, time.monotonic() + 60)
    w.on_done(0, Record(start=0, end=1, error="HTTP 503: full"))
    assert "HTTP 503" in w.reason


def test_shared_prefix_share_agrees_with_the_block_manager():
    from handler.engine.blocks import BlockManager

    rng = random.Random(0)
    stem = [rng.randrange(50) for _ in range(70)]
    prompts = [stem[:rng.choice([5, 16, 17, 33, 48, 70])] + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
               for _ in range(30)]
    bm = BlockManager(10_000, 16, enable_prefix_caching=True)
    for i, p in enumerate(prompts):
        bm.allocate(i, p, len(p))
        bm.commit(i, p, len(p))
    assert tune.shared_prefix_share(prompts, 16) == pytest.approx(bm.hit_tokens / sum(map(len, prompts)))
    assert bm.hit_tokens > 0


class CountTok:
    """A stand-in tokenizer: one token per word."""
    def __call__(self, text):
        return {"input_ids": text.split()}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(ids)


def test_traffic_file_parsing(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt_tokens": 12, "max_new_tokens": 20, "output_tokens": 5, "concurrency": 3}\n\n'
                 '{"prompt": "hello there", "max_new_tokens": 8}\n')
    tr = tune.traffic_from_jsonl(str(f), CountTok(), None, None)
    assert tr.concurrency == 3 and tr.arrivals is None and tr.prompt_tokens == [12, 2]
    assert tr.bodies[0]["parameters"] == {"max_new_tokens": 20, "ignore_eos": True, "details": True, "eos_after": 5}
    assert tr.outputs == [5, 8]
    f.write_text('{"prompt": "a", "max_new_tokens": 4, "arrival_s": 2.0}\n{"prompt": "b", "max_new_tokens": 4, "arrival_s": 2.5}\n')
    tr = tune.traffic_from_jsonl(str(f), CountTok(), None, None)
    assert tr.arrivals == [0.0, 0.5] and tr.in_flight(1.0) == 2
    bad = {'{"prompt": "a"}': "max_new_tokens is required",
           '{"prompt": "a", "prompt_tokens": 3, "max_new_tokens": 1}': "exactly one of prompt",
           '{"prompt": "a", "max_new_tokens": 0}': "max_new_tokens=0 is not an integer >= 1",
           '{"prompt": "a", "max_new_tokens": 2, "arival_s": 1}': "unknown field 'arival_s'",
           '[1]': "a JSON object per line",
           '{"prompt": "a", "max_new_tokens": 2}': "no arrival_s and no concurrency",
           '{"prompt": "a", "max_new_tokens": 2, "arrival_s": 1}\n{"prompt": "b", "max_new_tokens": 2}':
               "arrival_s on 1 of 2 lines"}
    for text, msg in bad.items():
        f.write_text(text + "\n")
        with pytest.raises(tune.UsageError, match=msg):
            tune.traffic_from_jsonl(str(f), CountTok(), None, None)
    f.write_text('{"prompt": "a", "max_new_tokens": 2}\nnot json\n')
    with pytest.raises(tune.UsageError, match=r"t.jsonl:2: not JSON"):
        tune.traffic_from_jsonl(str(f), CountTok(), 2, None)


def test_open_loop_sends_at_the_arrival_times():
    """run_load(arrivals=...) against a tiny server that answers at once."""
    from werkzeug.serving import make_server
    from flask import Flask, jsonify

    from handler.tools.bench.client import run_load

    app = Flask("t")
    app.post("/invocations")(lambda: jsonify({"generated_text": "x", "details": {"generated_tokens": 1}}))
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        arrivals = [0.0, 0.4, 0.2, 0.6]
        recs, _ = run_load(f"http://127.0.0.1:{srv.server_port}/invocations", [{"inputs": "a"}] * 4, 1,
                           progress=False, arrivals=arrivals)
        for r, a in zip(recs, arrivals):
            assert a - 0.02 <= r.start <= a + 0.15, (r.start, a)
    finally:
        srv.shutdown()


# ------------------------------------------------------------------ the whole flow, measure() faked
def fake_tune(monkeypatch, model_dir, out, figures: list[dict], spend_s: float, budget_minutes: float, slo: dict):
    """tune() with each candidate's measurement replaced by the given figures."""
    calls = []

    def measure(c, idx, *a, **k):
        calls.append(idx)
        return dict(figures[idx % len(figures)], complete=True, stopped=None, measure_s=spend_s,
                    summary={"n": 8, "completed": 8, "errors": 0, "duration_s": 8 / figures[idx % len(figures)]["requests_per_s"],
                             "output_tokens_per_s": 1.0, "latency_p50": 0.1, "ttft_p50": 0.1, "tpot_p50": 0.01,
                             "error_samples": []})
    monkeypatch.setattr(tune, "measure", measure)
    res, code = tune.tune(model_dir, "lmi", str(out), preset="cpu", slo=slo, budget_minutes=budget_minutes,
                          progress=False, log=lambda m: None)
    return res, code, calls


def test_tune_flow_rule_and_budget(demo_model_dir, tmp_path, monkeypatch):
    f = [dict(requests_per_s=4.0, ttft_p90_ms=100.0, tpot_p90_ms=10.0, latency_p90_s=1.0),
         dict(requests_per_s=9.0, ttft_p90_ms=900.0, tpot_p90_ms=10.0, latency_p90_s=3.0),
         dict(requests_per_s=6.0, ttft_p90_ms=200.0, tpot_p90_ms=10.0, latency_p90_s=1.5)]
    res, code, calls = fake_tune(monkeypatch, demo_model_dir, tmp_path / "a", f, 0.0, 10, {"latency_p90_s": 2.0})
    assert code == 0 and len(calls) == len(res["candidates"]) >= 5
    rps = [c["requests_per_s"] for c in res["candidates"]]
    # every candidate i got figures f[i % 3]; the fastest within 2 s is a 6.0 one (9.0 misses)
    assert [c["meets_slo"] for c in res["candidates"]] == [f[i % 3]["latency_p90_s"] <= 2.0 for i in range(len(rps))]
    assert rps[res["chosen"]] == 6.0
    text = (tmp_path / "a" / "serving.properties").read_text()
    assert parse_properties(text) == res["candidates"][res["chosen"]]["properties"]
    assert "baseline (baseline): 4.00 req/s" in text and "1.50x" in text

    # a budget of 30 s, a candidate that took 40 s: the second is not started
    res, code, calls = fake_tune(monkeypatch, demo_model_dir, tmp_path / "b", f, 40.0, 0.5, {"latency_p90_s": 0.5})
    assert calls == [0] and code == tune.NOTHING_MET
    assert all(c["stopped"].startswith("not measured") for c in res["candidates"][1:])
    assert res["chosen"] is None and res["closest"] == 0
    assert (tmp_path / "b" / "serving.properties").read_text().startswith("# NO CANDIDATE MET")


def test_confirm_alternates_the_order_and_pools_the_passes(monkeypatch):
    class Srv:
        error = None

        def __init__(self, name):
            self.name = name

        def stop(self):
            stopped.append(self.name)
    order, stopped = [], []
    rps = {"chosen": [10.0, 4.0], "baseline": [5.0, 4.0]}
    monkeypatch.setattr(tune, "start_server", lambda c, *a: Srv(c.name))

    def load(srv, tr, slo, beat_s, deadline, progress, desc):
        assert slo == {} and beat_s is None            # no early stop when confirming
        x = rps[srv.name][sum(o == srv.name for o in order)]
        order.append(srv.name)
        return {"requests_per_s": x, "ttft_p90_ms": 1.0, "tpot_p90_ms": 1.0, "latency_p90_s": 1.0,
                "summary": {"completed": 20, "duration_s": 20 / x}}
    monkeypatch.setattr(tune, "load", load)
    tr = tune.Traffic("t", [{"inputs": "a", "parameters": {"max_new_tokens": 2}}] * 20, [1] * 20, concurrency=2)
    pair = [(3, tune.Candidate("chosen", {}, "")), (0, tune.Candidate("baseline", {}, ""))]
    out = tune.confirm(pair, tr, "m", "r", 2, 1.0, False, lambda m: None)
    assert order == ["chosen", "baseline", "baseline", "chosen"] and sorted(stopped) == ["baseline", "chosen"]
    assert out["candidates"]["3"]["requests_per_s"] == pytest.approx(40 / (2 + 5))      # pooled: 40 requests in 7 s
    assert out["ratio_chosen_to_baseline"] == pytest.approx((40 / 7) / (40 / 9))
    assert out["ratio_per_pass"] == [2.0, 1.0]


def test_candidates_give_reasons_and_respect_the_budget(demo_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    tr = tune.traffic_from_workload(tune.preset_workload("early_stop", "cpu"), tok)
    base = load_config(None, demo_model_dir, env={})
    cands = tune.propose(tr, base, explain.read_geometry(demo_model_dir), {"latency_p90_s": 2}, 8, tok)
    kinds = {c.properties.get("option.paged_attention", "dynamic" if "max_batch_delay" in c.properties else "?")
             for c in cands}
    assert kinds >= {"true", "false", "dynamic"}
    assert len({tuple(sorted(c.properties.items())) for c in cands}) == len(cands)
    def explained_for(c, prompt):
        path = tmp_path / "c.properties"
        path.write_text(tune.properties_text(c.properties))
        return explain.explain(load_config(str(path), demo_model_dir, env={}), explain.read_geometry(demo_model_dir),
                               device="cpu", prompt_tokens=prompt, output_lengths=tr.outputs,
                               max_new_tokens=max(tr.max_new))["mix"]
    width = lambda c: int(c.properties.get("option.max_rolling_batch_size", c.properties.get("batch_size", 0)))  # noqa: E731
    for c in cands:
        assert int(c.properties["option.kv_cache_tokens"]) <= tr.kv_budget and c.reason
    # the pool cannot hold all 50 clients' sequences on average: a paged candidate is capped at what it holds
    paged = [c for c in cands if c.properties.get("option.paged_attention") == "true"]
    held = explained_for(paged[0], round(sum(tr.prompt_tokens) / tr.n))["paged_sequences_in_steady_state"]
    assert held < tr.concurrency and any(width(c) <= held + 1 for c in paged), (held, [width(c) for c in paged])
    # rolling and dynamic are no wider than the reservations (longest prompt + max_new_tokens) the pool holds
    for c in cands[1:]:
        if c.properties.get("option.paged_attention") != "true":
            assert width(c) <= explained_for(c, max(tr.prompt_tokens))["sequences_at_prompt_plus_max_new_tokens"], c.name
    # early_stop's prompts share the bench paragraph's opening: prefix caching is proposed
    assert any(c.properties.get("option.enable_prefix_caching") == "true" for c in cands)


# ------------------------------------------------------------------ end to end (slow)
def run_tune(args, timeout=480):
    return subprocess.run([sys.executable, "-m", "handler", "tune", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_tune_smoke_writes_the_fastest_candidate_that_meets(demo_model_dir, tmp_path):
    out = tmp_path / "out"
    slo = {"latency_p90_s": 60.0, "ttft_p90_ms": 60_000.0}
    t0 = time.monotonic()
    r = run_tune(["--model-dir", demo_model_dir, "--workload", "early_stop", "--preset", "smoke",
                  "--slo", ",".join(f"{k}={v}" for k, v in slo.items()), "--budget-minutes", "6", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert time.monotonic() - t0 < 420
    res = json.loads((out / "tune.json").read_text())
    cands = res["candidates"]
    assert 2 <= len(cands) <= 3 and res["baseline"] == cands[0]
    for c in cands:
        assert set(c) >= {"properties", "requests_per_s", "ttft_p90_ms", "tpot_p90_ms", "latency_p90_s", "meets_slo"}
        # meets_slo agrees with the figures recorded next to it
        within = all(c[k] is not None and c[k] <= v for k, v in slo.items())
        assert c["meets_slo"] == (bool(c.get("complete")) and within), c
    ok = [i for i, c in enumerate(cands) if c["meets_slo"]]
    assert ok, cands
    chosen = res["chosen"]
    assert chosen in ok and all(cands[chosen]["requests_per_s"] >= cands[i]["requests_per_s"] for i in ok)
    # the file is the chosen candidate, loads, and its comments carry the figures
    text = (out / "serving.properties").read_text()
    assert parse_properties(text) == cands[chosen]["properties"]
    assert f"{cands[chosen]['requests_per_s']:.2f} req/s" in text and "why it won" in text
    cfg = load_config(str(out / "serving.properties"), demo_model_dir, env={})
    assert cfg.kv_cache_tokens is not None
    assert (out / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tune_says_so_when_nothing_meets_the_objective(demo_model_dir, tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt_tokens": 6 + i, "max_new_tokens": 6, "concurrency": 2}) + "\n"
                               for i in range(6)))
    out = tmp_path / "out"
    r = run_tune(["--model-dir", demo_model_dir, "--workload", str(traffic), "--preset", "smoke",
                  "--slo", "latency_p90_s=0.001", "--budget-minutes", "6", "--out", str(out)])
    assert r.returncode == tune.NOTHING_MET, r.stderr[-3000:]
    assert "NO candidate met the objective (latency_p90_s <= 0.001)" in r.stderr
    res = json.loads((out / "tune.json").read_text())
    assert res["chosen"] is None and res["closest"] is not None
    cands = res["candidates"]
    assert not any(c["meets_slo"] for c in cands)
    # each was stopped early: two requests over the target already fix a p90 of 6 (rank 4.5)
    assert all("latency p90 must miss" in c["stopped"] for c in cands), [c.get("stopped") for c in cands]
    text = (out / "serving.properties").read_text()
    assert text.startswith("# NO CANDIDATE MET THE OBJECTIVE")
    assert parse_properties(text) == cands[res["closest"]]["properties"]


@pytest.mark.slow
def test_sigterm_stops_the_running_candidate_server(demo_model_dir, tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt_tokens": 8, "max_new_tokens": 200, "concurrency": 1}) + "\n"
                               for _ in range(8)))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "handler", "tune", "--no-progress", "--model-dir", demo_model_dir,
                             "--workload", str(traffic), "--preset", "smoke", "--budget-minutes", "10",
                             "--out", str(out)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    log = out / "runs" / "candidate-0.log"
    deadline = time.monotonic() + 240
    while not (log.exists() and "ready: strategy" in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the first candidate never became ready"
        time.sleep(0.5)
    proc.terminate()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    assert "Shutting down: Master" in log.read_text()     # gunicorn's master went down with it
