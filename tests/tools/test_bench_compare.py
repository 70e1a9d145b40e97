"""The load client against a scripted server, the comparison's bookkeeping, and (slow) a real
end-to-end `compare` on a tiny workload with our servers and both peers."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from handler.tools.bench import cli
from handler.tools.bench.client import run_load, send_one
from handler.tools.bench.compare import (add_ratios, compare, cpu_figures, kv_cache_tokens, properties,
                                   write_results)
from handler.tools.bench.workloads import Preset, Workload, output_lengths


# ------------------------------------------------------------------ a scripted server
def _fake_app():
    from flask import Flask, Response, jsonify, request

    app = Flask("fake")

    @app.post("/invocations")
    def inv():
        body = request.get_json()
        mode = body["inputs"]
        if mode == "full":
            return jsonify({"code": 503, "message": "queue is full"}), 503
        if mode == "json":
            return jsonify({"generated_text": "abc", "details": {"finish_reason": "length",
                                                                  "generated_tokens": 7}})

        def lines():
            time.sleep(0.3)                               # time to first token
            for i in range(3):
                msg = {"token": {"id": i, "text": "x", "log_prob": -1.0}}
                if i == 2:
                    msg.update(generated_text="xxx", details={"finish_reason": "eos_token",
                                                               "generated_tokens": 3})
                yield json.dumps(msg) + "\n"
                time.sleep(0.1)
        return Response(lines(), mimetype="application/jsonlines")

    return app


@pytest.fixture(scope="module")
def fake_url():
    from werkzeug.serving import WSGIRequestHandler, make_server

    WSGIRequestHandler.protocol_version = "HTTP/1.1"   # chunked, as gunicorn streams
    srv = make_server("127.0.0.1", 0, _fake_app(), threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}/invocations"
    srv.shutdown()


def test_client_times_the_first_streamed_token(fake_url):
    import requests

    with requests.Session() as s:
        r = send_one(s, fake_url, {"inputs": "stream", "stream": True}, time.perf_counter(), 10)
    assert r.error is None and r.tokens == 3 and r.finish_reason == "eos_token"
    assert 0.25 <= r.ttft < r.latency                  # first token after the 0.3 s pause
    assert r.latency - r.ttft >= 0.18                  # two more tokens 0.1 s apart


def test_client_reads_json_answers_and_errors(fake_url):
    import requests

    with requests.Session() as s:
        ok = send_one(s, fake_url, {"inputs": "json"}, time.perf_counter(), 10)
        bad = send_one(s, fake_url, {"inputs": "full"}, time.perf_counter(), 10)
    assert ok.error is None and ok.tokens == 7 and ok.ttft is None
    assert bad.error == "HTTP 503: queue is full"


def test_closed_loop_keeps_order_and_concurrency(fake_url):
    bodies = [{"inputs": "stream", "stream": True}] * 4
    recs, dur = run_load(fake_url, bodies, concurrency=2, progress=False)
    assert len(recs) == 4 and all(r.tokens == 3 for r in recs)
    # two clients, each running two ~0.5 s requests back to back: ~1 s, not ~0.5 s or ~2 s
    assert 0.9 <= dur < 1.9
    starts = sorted(r.start for r in recs)
    assert starts[1] - starts[0] < 0.2 and starts[2] - starts[0] > 0.4


# ------------------------------------------------------------------ bookkeeping
def test_kv_capacity_counts_reservations_of_the_longest_sequence():
    w = Workload(name="t", requests=1, concurrency=50, prompt_words=(1,), max_new_tokens=(16, 64))
    # longest prompt 150 + 64 = 214 tokens = 13.4 blocks -> 14, + 1 spare = 15 blocks of 16
    assert kv_cache_tokens(w, [10, 150]) == 50 * 15 * 16
    w12 = Workload(name="t", requests=1, concurrency=50, prompt_words=(1,), max_new_tokens=(64,),
                   kv_reservations=12)
    assert kv_cache_tokens(w12, [16]) == 12 * 6 * 16   # 80 tokens = 5 blocks, + 1


@pytest.mark.parametrize("strategy", ["none", "dynamic", "rolling", "paged"])
def test_properties_select_the_strategy(tmp_path, strategy):
    from handler.config import load_config

    w = Workload(name="t", requests=1, concurrency=50, prompt_words=(1,), max_new_tokens=(4,))
    path = tmp_path / "serving.properties"
    path.write_text(properties(strategy, w, 4096, None))
    cfg = load_config(str(path), str(tmp_path), env={}, check_model=False)
    assert cfg.strategy == strategy and cfg.kv_cache_tokens == 4096
    assert list(cfg.warnings) == []
    if strategy == "dynamic":
        assert cfg.batch_size == 50 and cfg.max_batch_delay_ms == w.max_batch_delay_ms


def _entry(rps, cpu_s=None):
    return {"requests_per_s": rps, "output_tokens_per_s": rps * 10, "lmi_requests_per_s": rps,
            "errors": 0, "latency_p50": 1.0, "latency_p90": 2.0, "latency_p99": 3.0,
            "ttft_p50": None, "ttft_p99": None, "tpot_p50": None, "tpot_p99": None,
            **(cpu_figures([cpu_s], 2000) if cpu_s is not None else {})}


def test_ratios_and_report_files(tmp_path):
    entries = {"dynamic": _entry(2.0), "paged": _entry(3.0, cpu_s=5.0), "hf_naive": _entry(1.0),
               "transformers_cb": _entry(4.0), "vllm_cpu": _entry(6.0, cpu_s=3.0),
               "rolling": {"error": "failed to start"}}
    add_ratios(entries, {"from_draws": 2.0})
    assert entries["paged"]["vs_dynamic"] == pytest.approx(1.5)
    assert entries["paged"]["vs_vllm_cpu"] == pytest.approx(0.5)
    assert entries["paged"]["cpu_s_per_1k_output_tokens"] == pytest.approx(2.5)   # 5 s / 2,000 tokens
    assert entries["paged"]["vs_hf_naive"] == pytest.approx(3.0)
    assert entries["paged"]["vs_transformers_cb"] == pytest.approx(0.75)
    assert entries["paged"]["share_of_ideal"] == pytest.approx(0.75)     # 1.5 of an ideal 2.0
    workload = {"note": "n", "requests": 6, "concurrency": 2, "prompt_tokens": [3], "max_new_tokens": [4],
                "eos_after": None, "kv_cache_tokens": 96, "repetitions": 1,
                "ideal": {"batch_width": 2, "from_draws": 2.0, "expected": 1.9}}
    wl = {"strategies": {k: entries[k] for k in ("dynamic", "rolling", "paged")},
          "peers": {k: entries[k] for k in ("hf_naive", "transformers_cb", "vllm_cpu")}, "workload": workload}
    results = {**wl, "workloads": {"w": wl}, "preset": "t", "elapsed_s": 1.0,
               "machine": {"platform": "p", "cpus": 2, "cuda": None, "torch": "t", "transformers": "x",
                           "date": "d"}}
    write_results(results, str(tmp_path))
    md = (tmp_path / "results.md").read_text()
    assert "| paged | 3.00 |" in md and "| rolling | failed: failed to start" in md
    assert "| transformers_cb (peer) | 4.00 |" in md
    header = next(line for line in md.splitlines() if line.startswith("| server |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert "× vllm_cpu" in cols and "CPU-s / 1k out tok" in cols
    paged = [c.strip() for c in next(line for line in md.splitlines() if line.startswith("| paged |")).strip("|").split("|")]
    assert paged[cols.index("× vllm_cpu")] == "0.50" and paged[cols.index("CPU-s / 1k out tok")] == "2.50"
    vllm = [c.strip() for c in next(line for line in md.splitlines()
                                    if line.startswith("| vllm_cpu (peer) |")).strip("|").split("|")]
    assert vllm[cols.index("CPU-s / 1k out tok")] == "1.50" and vllm[cols.index("× vllm_cpu")] == "1.00"
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "results.json").read_text())["strategies"]["paged"]["vs_dynamic"] == 1.5


def test_cli_rejects_bad_input_in_one_line(tmp_path, capsys):
    assert cli.main(["compare", "--out", str(tmp_path), "--only", "paged,bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --only='paged,bogus': unknown name 'bogus'") and "\n" not in err
    assert cli.main(["run", "--url", "http://127.0.0.1:9", "--max-new-tokens", "64,x"]) == 2
    assert "--max-new-tokens='64,x'" in capsys.readouterr().err
    assert cli.main(["run", "--url", "http://127.0.0.1:9", "--workload", "nope"]) == 2
    assert "allowed: lmi, early_stop" in capsys.readouterr().err


def test_arms_parse_and_refuse_bad_specs_in_one_line(tmp_path):
    from handler.tools.bench.compare import Arm

    a = Arm.parse("after=paged+option.target_tpot_ms=80+option.scheduling_policy=priority")
    assert (a.name, a.strategy, a.root) == ("after", "paged", None)
    assert a.property("option.target_tpot_ms") == "80" and a.property("option.block_size") is None
    (tmp_path / "handler").mkdir()
    (tmp_path / "handler" / "__main__.py").write_text("")
    b = Arm.parse(f"before=paged_int8@{tmp_path}")
    assert (b.strategy, b.root, b.extra) == ("paged_int8", str(tmp_path), ())
    for bad, why in (("paged=paged", "a new name"), ("x=turbo", "strategy 'turbo'"),
                     ("x=paged+option.a", "'option.a' is not key=value"), ("x", "a new name"),
                     (f"x=paged@{tmp_path / 'nope'}", "not a checkout")):
        with pytest.raises(ValueError, match=why):
            Arm.parse(bad)


def test_an_arm_serves_its_extra_properties_and_checkout(tmp_path, monkeypatch):
    from handler.tools.bench.compare import Arm, make_servers

    (tmp_path / "handler").mkdir()
    (tmp_path / "handler" / "__main__.py").write_text("")
    w = Workload(name="t", requests=1, concurrency=4, prompt_words=(1,), max_new_tokens=(4,))
    arms = {a.name: a for a in (Arm.parse("after=paged+option.target_tpot_ms=80"),
                                Arm.parse(f"before=paged@{tmp_path}"))}
    monkeypatch.chdir(tmp_path)
    servers = {s.name: s for s in make_servers(["paged", "after", "before"], w, ".", 4096, ".", None, arms=arms)}
    props = (tmp_path / "after.properties").read_text()
    assert props == (tmp_path / "paged.properties").read_text() + "option.target_tpot_ms=80\n"
    assert servers["before"].cwd == str(tmp_path) and servers["before"].env["PYTHONPATH"] == str(tmp_path)
    assert servers["after"].cwd is None and servers["paged"].cwd is None
    cmd = servers["before"].cmd      # started in the other checkout: every path absolute
    assert os.path.isabs(cmd[cmd.index("--properties") + 1]) and os.path.isabs(cmd[cmd.index("--model-dir") + 1])


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_compare_end_to_end(tmp_path, demo_model_dir):
    # max_new_tokens 4/8 and EOS after K in 2..6: some requests end by length, some by "EOS"
    w = Workload(name="tiny", requests=6, concurrency=2, prompt_words=(4, 12), max_new_tokens=(4, 8),
                 eos_after=(2, 6), dynamic_batch_size=2, max_batch_delay_ms=20, prefill_tokens=512)
    only = ["dynamic", "paged", "hf_naive", "transformers_cb"]
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path), only=only,
                  model_dir=demo_model_dir, progress=False, log=lambda m: None)
    assert set(res["strategies"]) == {"dynamic", "paged"} and set(res["peers"]) == {"hf_naive", "transformers_cb"}
    want_tokens = sum(output_lengths(w.draw()))
    want_eos = sum(1 for b in w.draw() if b["parameters"]["eos_after"] <= b["parameters"]["max_new_tokens"])
    for name, e in {**res["strategies"], **res["peers"]}.items():
        assert e["completed"] == 6 and e["errors"] == 0, (name, e)
        assert e["output_tokens"] == want_tokens, name               # counted from details/stream lines
        assert e["finish_reasons"].get("eos_token", 0) == want_eos, name
        for k in ("requests_per_s", "output_tokens_per_s", "lmi_requests_per_s", "latency_p50", "latency_p99",
                  "cpu_s_per_1k_output_tokens"):
            assert e[k] > 0, (name, k)
    assert res["strategies"]["dynamic"]["vs_dynamic"] == pytest.approx(1.0)
    assert res["strategies"]["paged"]["ttft_p50"] is not None          # our servers stream
    assert res["peers"]["hf_naive"]["ttft_p50"] is None                 # the naive peer does not
    assert res["workload"]["kv_cache_tokens"] == kv_cache_tokens(w, res["workload"]["prompt_tokens"])
    for f in ("results.json", "results.md", "results.png"):
        assert os.path.getsize(tmp_path / f) > 0
    md = (tmp_path / "results.md").read_text()
    assert all(f"| {n}" in md for n in only)


def test_materialise_random_pads_the_tokenizer_to_the_config_vocab(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from handler.tools.bench.compare import materialise_random

    cfg_dir = tmp_path / "cfg"
    # the demo corpus trains ~29k tokens, so a 40k vocabulary needs unused padding tokens
    LlamaConfig(vocab_size=40000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2).save_pretrained(cfg_dir)
    out = materialise_random(str(cfg_dir / "config.json"), str(tmp_path / "model"), "bfloat16")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(tok) == 40000 == model.config.vocab_size     # every sampled id decodes
    assert str(model.dtype) == "torch.bfloat16"
    assert tok.decode([39999]).startswith("<unused_")


def test_properties_carry_the_tensor_parallel_degree(tmp_path):
    from handler.config import load_config

    w = Workload(name="t", requests=1, concurrency=2, prompt_words=(1,), max_new_tokens=(4,))
    path = tmp_path / "serving.properties"
    path.write_text(properties("paged", w, 4096, None, 2))
    cfg = load_config(str(path), str(tmp_path), env={}, check_model=False, gpu_count=0)
    assert (cfg.strategy, cfg.tensor_parallel_degree) == ("paged", 2)
    assert "tensor_parallel_degree" not in properties("paged", w, 4096, None)


@pytest.mark.slow
def test_compare_at_degree_2_is_labelled_a_correctness_run(tmp_path, demo_model_dir):
    w = Workload(name="tiny", requests=4, concurrency=2, prompt_words=(4,), max_new_tokens=(4,),
                 prefill_tokens=512)
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path), only=["paged"],
                  model_dir=demo_model_dir, progress=False, log=lambda m: None, tensor_parallel_degree=2)
    e = res["strategies"]["paged"]
    assert e["completed"] == 4 and e["errors"] == 0, e
    assert res["tensor_parallel_degree"] == 2
    log = (tmp_path / "runs" / "tiny" / "paged.log").read_text()
    assert "rank 1 of 2" in log                        # the server really ran two ranks
    md = (tmp_path / "results.md").read_text()
    assert "Tensor parallel degree 2" in md and "correctness run" in md
