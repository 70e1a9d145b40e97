"""`python -m handler bench engine-loop` (handler/tools/bench/engine_loop.py): the in-process closed loop
answers every request with exactly the tokens it asked for, never more than `concurrency` in flight,
and writes its figures."""
import json

import pytest

from handler.tools.bench import engine_loop
from handler.tools.bench.inprocess import make_engine


def test_closed_loop_answers_every_request_with_its_tokens(demo_model_dir):
    engine = make_engine(demo_model_dir, "fp32", 4, 2048, prefill_tokens=256)
    reqs = engine_loop.draw(9, [3, 11], [2, 5, 7], engine.tokenizer.vocab_size, seed=1)
    seen = []
    real_submit = engine.submit

    def submit(ids, params, **kw):
        seen.append(engine.admission.live)              # sequences admitted, not yet ended
        return real_submit(ids, params, **kw)

    engine.submit = submit
    res = engine_loop.closed_loop(engine, reqs, concurrency=3)
    assert res["requests"] == 9
    assert res["output_tokens"] == sum(m for _, m in reqs)       # ignore_eos: all of them
    assert res["iterations"] >= max(m for _, m in reqs)
    assert max(seen) < 3                                         # at most 3 in flight
    assert res["req_per_s"] > 0 and res["cpu_s_per_1k_out_tok"] > 0
    # Latency figures from the engine's own event times: every token after a request's first comes a
    # step after the one before, so TPOT is positive; TTFT p90 >= p50 >= the quickest first token.
    assert 0 < res["tpot_p50_ms"] <= res["tpot_p90_ms"]
    assert 0 < res["ttft_p50_ms"] <= res["ttft_p90_ms"] < 1000.0 * res["wall_s"]


def test_main_writes_every_repetition(demo_model_dir, tmp_path):
    out = tmp_path / "loop.json"
    assert engine_loop.main(["--model-dir", demo_model_dir, "--requests", "6", "--concurrency", "2",
                             "--prompt-tokens", "4,9", "--max-new-tokens", "3", "--reps", "2",
                             "--kv-tokens", "1024", "--max-running", "4", "--arm", "decode_stack=0",
                             "--property", "option.target_tpot_ms=500", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["arms"] == ["decode_stack=0"]
    assert data["properties"] == {"option.target_tpot_ms": "500"}
    assert [r["requests"] for r in data["runs"]] == [6, 6]
    assert [r["output_tokens"] for r in data["runs"]] == [18, 18]
    assert data["prompt_tokens"] == [4, 9] and data["concurrency"] == 2


def test_preset_requests_are_the_served_bodies_tokenized(demo_model_dir):
    # Oracle: the bench's own bodies for the `cpu` preset, tokenized here the way the server's
    # /invocations does (api.tokenize), with each body's max_new_tokens.
    from transformers import AutoTokenizer

    from handler.http.protocols import Generation, tokenize
    from handler.tools.bench.workloads import PRESETS
    from handler.engine.request import SamplingParams
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    got = engine_loop.from_preset("cpu", tok)
    bodies = next(w for w in PRESETS["cpu"].workloads if w.name == "lmi").draw(tok)
    assert len(got) == len(bodies) == 250
    for (ids, m), b in zip(got, bodies):
        want = tokenize(tok, Generation([b["inputs"]], SamplingParams()))[0]
        assert ids == want and m == b["parameters"]["max_new_tokens"]
    assert len({m for _, m in got}) == 3 and len({len(ids) for ids, _ in got}) >= 3


def test_the_bench_command_refuses_an_unknown_arm_in_one_line(demo_model_dir, capsys):
    from handler.tools.bench.cli import main
    with pytest.raises(SystemExit) as e:
        main(["engine-loop", "--model-dir", demo_model_dir, "--arm", "gemm=mkl"])
    assert e.value.code == 2
    assert "gemm='mkl': allowed panels, onednn" in capsys.readouterr().err


def test_a_property_that_is_not_a_key_or_a_bad_value_is_refused_in_one_line(demo_model_dir, capsys):
    from handler.tools.bench.cli import main
    with pytest.raises(SystemExit) as e:
        main(["engine-loop", "--model-dir", demo_model_dir, "--property", "target_tpot_ms"])
    assert e.value.code == 2 and "expected option.KEY=VALUE" in capsys.readouterr().err
    assert engine_loop.main(["--model-dir", demo_model_dir, "--property", "option.target_tpot_ms=fast"]) == 2
    assert "option.target_tpot_ms" in capsys.readouterr().err


def test_shared_prefix_starts_every_prompt_with_the_same_tokens(demo_model_dir, tmp_path, monkeypatch):
    # --shared-prefix N: a system prompt ahead of each drawn prompt (warm-up included), so that with
    # prefix caching each prompt's rest is a chunk after cached rows; every request still answered in full.
    seen, real = [], engine_loop.closed_loop
    monkeypatch.setattr(engine_loop, "closed_loop", lambda engine, reqs, c: seen.append(reqs) or real(engine, reqs, c))
    out = tmp_path / "loop.json"
    assert engine_loop.main(["--model-dir", demo_model_dir, "--requests", "5", "--concurrency", "2",
                             "--prompt-tokens", "4,9", "--max-new-tokens", "3", "--reps", "1", "--kv-tokens", "1024",
                             "--max-running", "4", "--shared-prefix", "40",
                             "--property", "option.enable_prefix_caching=true", "--out", str(out)]) == 0
    assert [len(r) for r in seen] == [2, 5]
    heads = {tuple(ids[:40]) for reqs in seen for ids, _ in reqs}
    assert len(heads) == 1 and all(len(ids) - 40 in (4, 9) for reqs in seen for ids, _ in reqs)
    data = json.loads(out.read_text())
    assert data["shared_prefix"] == 40 and [r["output_tokens"] for r in data["runs"]] == [15]
