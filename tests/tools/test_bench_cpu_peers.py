"""Issue 34's measurement pieces: the OpenVINO GenAI and llama.cpp peers (request translation,
stream parsing, the settings they are started with, skip-with-install-command), the GFLOP/s
arithmetic and parameter count, and the load curve's bookkeeping; one test per peer that runs
it for real where it is installed (skipped with the install command otherwise)."""
from __future__ import annotations

import json
import os

import pytest

from handler.tools.bench import cli, llamacpp_peer, openvino_peer, peak
from handler.tools.bench.client import LlamaCppCompletions
from handler.tools.bench.compare import (INSTALL_HINTS, OPENVINO, LLAMACPP, compare, curve_point, curve_requests,
                                         markdown)
from handler.tools.bench.metrics import Record
from handler.tools.bench.workloads import Preset, Workload, output_lengths


# ------------------------------------------------------------------ llama.cpp request/answer
class _Tok:
    """A stand-in tokenizer: one id per character (what matters is that ids, not text, go out)."""

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


class _Resp:
    def __init__(self, lines, ctype="text/event-stream"):
        self.headers = {"content-type": ctype}
        self._lines = lines

    def iter_lines(self, chunk_size=None):
        yield from self._lines

    def json(self):
        return json.loads(self._lines[0])


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def test_llamacpp_body_sends_token_ids_and_turns_the_prompt_cache_off():
    b = {"inputs": "hey", "parameters": {"max_new_tokens": 9, "ignore_eos": True, "details": True,
                                         "eos_after": 4, "guided_json": {"type": "object"}}, "stream": True}
    out = LlamaCppCompletions(_Tok()).body(b)
    assert out["prompt"] == [104, 101, 121]          # the ids, not the text
    assert out["cache_prompt"] is False
    assert (out["max_tokens"], out["ignore_eos"], out["temperature"], out["stream"]) == (4, True, 0, True)
    assert out["stream_options"] == {"include_usage": True}
    assert "structured_outputs" not in out          # vLLM's field; llama.cpp would not honour it


def test_llamacpp_stream_counts_usage_and_times_the_first_chunk():
    """llama-server's /v1/completions stream: one chunk per token, the last with finish_reason
    and usage; an empty `choices` list does not count as a first token."""
    lines = [b"", _sse({"choices": [], "usage": None}),
             _sse({"choices": [{"text": "a", "index": 0, "finish_reason": None}]}),
             _sse({"choices": [{"text": "b", "index": 0, "finish_reason": None}]}),
             _sse({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                   "usage": {"completion_tokens": 2, "prompt_tokens": 3}}),
             b"data: [DONE]"]
    rec = Record(start=0.0, end=0.0)
    body = {"inputs": "hey", "parameters": {"max_new_tokens": 2}}
    LlamaCppCompletions(_Tok()).read(_Resp(lines), rec, t0=-5.0, body=body)
    assert (rec.error, rec.tokens, rec.finish_reason) == (None, 2, "length")
    assert rec.ttft is not None and rec.ttft > 0
    stop = [_sse({"choices": [{"text": "", "index": 0, "finish_reason": "stop"}],
                  "usage": {"completion_tokens": 1}})]
    rec2 = Record(start=0.0, end=0.0)
    LlamaCppCompletions(_Tok()).read(_Resp(stop), rec2, t0=0.0, body=body)
    assert (rec2.tokens, rec2.finish_reason) == (1, "eos_token")
    broken = [_sse({"choices": [{"text": "a", "index": 0, "finish_reason": None}]})]
    rec3 = Record(start=0.0, end=0.0)
    LlamaCppCompletions(_Tok()).read(_Resp(broken), rec3, t0=0.0, body=body)
    assert "usage" in rec3.error


# ------------------------------------------------------------------ started with equal settings
def test_llamacpp_server_flags_hold_the_kv_slots_budget_threads_and_kv_type():
    cmd, env, held = llamacpp_peer.server("/p", "/m/x.gguf", 1234, 12800, 64, 4096, "bf16", threads=2)
    flag = lambda f: cmd[cmd.index(f) + 1]  # noqa: E731
    assert cmd[0] == "/p/build/bin/llama-server" and "--kv-unified" in cmd
    assert (flag("-c"), flag("-np"), flag("-b"), flag("-t"), flag("-tb"), flag("-ctk"), flag("-ctv"),
            flag("--port"), flag("--cache-ram")) == ("12800", "64", "4096", "2", "2", "bf16", "bf16", "1234", "0")
    assert held["kv_cache_tokens"] == 12800 and held["kv_cache_type"] == "bf16"
    # the tools' shared libraries beside them (a build's recorded runpath may name another folder)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == "/p/build/bin"
    fp32 = llamacpp_peer.server("/p", "/m/x.gguf", 1, 128, 2, 512, "fp32")[0]
    assert (fp32[fp32.index("-ctk") + 1], fp32[fp32.index("-ctv") + 1]) == ("f32", "f32")
    assert [llamacpp_peer.outtype_of(c, d) for c, d in (("llamacpp", "fp32"), ("llamacpp", "bf16"),
                                                        ("llamacpp_q8", "fp32"), ("llamacpp_q8", "bf16"))] == \
        ["f32", "bf16", "q8_0", "q8_0"]
    with pytest.raises(ValueError, match="dtype='fp16': allowed fp32, bf16"):
        llamacpp_peer.outtype_of("llamacpp", "fp16")
    # split: each slot owns its share of the cells (attention over its own cells only)
    cmd, _, held = llamacpp_peer.server("/p", "/m/x.gguf", 1, 12800, 50, 4096, "fp32", kv_layout="split")
    assert "--no-kv-unified" in cmd and "--kv-unified" not in cmd and held["kv_tokens_per_slot"] == 256
    with pytest.raises(ValueError, match="kv_layout='paged': allowed unified, split"):
        llamacpp_peer.server("/p", "/m/x.gguf", 1, 12800, 50, 4096, "fp32", kv_layout="paged")


def test_split_llamacpp_kv_that_cannot_hold_the_longest_sequence_is_a_clear_error(tmp_path, demo_model_dir,
                                                                                   monkeypatch):
    # an installed-looking peer dir: the check comes before any conversion or start
    (tmp_path / "peer" / "build" / "bin").mkdir(parents=True)
    exe = tmp_path / "peer" / "build" / "bin" / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / "peer" / llamacpp_peer.MARKER).write_text("{}")
    w = Workload(name="tiny", requests=4, concurrency=2, prompt_words=(40,), max_new_tokens=(30,),
                 kv_cache_tokens=64)
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path / "out"), only=["llamacpp"],
                  model_dir=demo_model_dir, progress=False, log=lambda m: None, measure_peak=False,
                  peer_dirs={"llamacpp": str(tmp_path / "peer"), "llamacpp_kv": "split"})
    err = res["peers"]["llamacpp"]["error"]
    assert err.startswith("preparing") is False and "--llamacpp-kv split: 64 KV tokens / 2 slots = 32 per slot" in err


def test_llamacpp_gguf_serves_the_file_the_model_was_converted_from_or_is_skipped(tmp_path, demo_model_dir):
    from handler.tools.bench.compare import installed_peer
    peer = tmp_path / "peer"
    (peer / "build" / "bin").mkdir(parents=True)
    (peer / "build" / "bin" / "llama-server").write_text("#!/bin/sh\n")
    (peer / "build" / "bin" / "llama-server").chmod(0o755)
    (peer / llamacpp_peer.MARKER).write_text("{}")
    w = Workload(name="tiny", requests=2, concurrency=1, prompt_words=(4,), max_new_tokens=(2,))
    args = (w, demo_model_dir, 128, str(tmp_path / "log"), 1, "fp32", None, {"llamacpp": str(peer)})
    s = installed_peer("llamacpp_gguf", *args, log_fn=lambda m: None)
    assert s.cmd == [] and "was not converted from a .gguf file" in s.skipped
    # a model dir stamped as converted from a .gguf that exists: that very file is served, no conversion
    src = tmp_path / "q.gguf"
    src.write_bytes(b"GGUF")
    conv = tmp_path / "conv"
    conv.mkdir()
    for f in os.listdir(demo_model_dir):
        os.symlink(os.path.join(demo_model_dir, f), conv / f)
    (conv / "converted_from.json").write_text(json.dumps({"gguf": str(src), "size": 4}))
    s = installed_peer("llamacpp_gguf", w, str(conv), *args[2:], log_fn=lambda m: None)
    assert s.cmd[s.cmd.index("-m") + 1] == str(src) and s.held["gguf"] == "q.gguf"
    assert "llamacpp_gguf" in LLAMACPP and INSTALL_HINTS["llamacpp_gguf"] == "python -m handler bench install-peer llamacpp"


def test_llamacpp_converter_copy_renames_only_the_tokenizer_class(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", "eos_token": "x"}))
    out = llamacpp_peer.hf_copy(str(src), str(tmp_path / "copy"))
    assert os.path.islink(os.path.join(out, "config.json"))
    tc = json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text())
    assert tc == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "x"}
    assert json.loads((src / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"


def test_openvino_server_holds_kv_blocks_limits_and_precision():
    cmd, env, held = openvino_peer.server("/ov", "/ir", "/m", 1234, 12800, 64, 4096, "fp32", threads=2)
    flag = lambda f: cmd[cmd.index(f) + 1]  # noqa: E731
    assert cmd[:4] == ["/ov/bin/python", "-m", "handler.tools.bench.openvino_peer", "serve"]
    assert (flag("--kv-blocks"), flag("--max-num-seqs"), flag("--max-batched-tokens"), flag("--dtype"),
            flag("--threads"), flag("--tokenizer")) == ("400", "64", "4096", "fp32", "2", "/m")
    assert held["properties"] == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                  "INFERENCE_NUM_THREADS": 2}
    assert held["prefix_caching"] is False and held["kv_cache_tokens"] == 12800
    # a capacity that is not whole 32-token blocks rounds up to them
    assert openvino_peer.server("/ov", "/ir", "/m", 1, 100, 2, 512, "bf16")[2]["kv_cache_tokens"] == 128
    assert openvino_peer.server("/ov", "/ir", "/m", 1, 100, 2, 512, "bf16")[2]["properties"]["KV_CACHE_PRECISION"] \
        == "bf16"
    with pytest.raises(ValueError, match="allowed fp32, bf16"):
        openvino_peer.server("/ov", "/ir", "/m", 1, 100, 2, 512, "int8")
    with pytest.raises(ValueError, match="weight_format='int4': allowed fp32, int8"):
        openvino_peer.export("/ov", "/m", "int4")


# ------------------------------------------------------------------ skip with the install command
def test_absent_installed_peers_are_skipped_with_their_install_command(tmp_path, demo_model_dir):
    logs = []
    w = Workload(name="tiny", requests=2, concurrency=1, prompt_words=(4,), max_new_tokens=(2,))
    cells = [*OPENVINO, *LLAMACPP]
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path), only=cells,
                  model_dir=demo_model_dir, progress=False, log=logs.append, measure_peak=False,
                  peer_dirs={"openvino": str(tmp_path / "no-ov"), "llamacpp": str(tmp_path / "no-llama")})
    md = (tmp_path / "results.md").read_text()
    for cell, hint in (("openvino", "install-peer openvino"), ("openvino_int8", "install-peer openvino"),
                       ("llamacpp", "install-peer llamacpp"), ("llamacpp_q8", "install-peer llamacpp")):
        reason = res["peers"][cell]["skipped"]
        assert f"(python -m handler bench {hint})" in reason and "not installed" in reason, reason
        assert INSTALL_HINTS[cell] == f"python -m handler bench {hint}"
        assert any(m.startswith(f"[tiny] {cell} skipped:") for m in logs)
        assert f"| {cell} (peer) | skipped: " in md


def test_cli_names_the_new_cells_and_rejects_bad_client_counts(tmp_path, capsys):
    assert cli.main(["compare", "--out", str(tmp_path), "--only", "paged,openvino_q4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown name 'openvino_q4'" in err[0] and "llamacpp_q8" in err[0]
    assert cli.main(["compare", "--out", str(tmp_path), "--clients", "1,0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --clients='1,0'")


# ------------------------------------------------------------------ GFLOP/s
def test_achieved_gflops_is_two_flops_per_parameter_per_token():
    # 1,000 parameters, 30 prompt + 70 output tokens in 2 s: 2 * 1e3 * 100 / 2 = 1e5 flop/s
    got = peak.achieved(1000, 30, 70, 2.0, peak_gflops=1e-3)
    assert got["gflops"] == pytest.approx(1e-4)
    assert got["pct_of_peak"] == pytest.approx(10.0)
    assert peak.achieved(1000, 30, 70, 2.0)["pct_of_peak"] is None
    assert peak.achieved(1000, 30, 70, 0.0) == {"gflops": None, "pct_of_peak": None}
    with pytest.raises(ValueError):
        peak.flops(-1, 1, 1)


def test_parameter_count_from_headers_matches_the_loaded_model(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    assert peak.count_params(str(tmp_path)) == model.num_parameters()     # the tied head once
    with pytest.raises(ValueError, match="no .safetensors"):
        peak.count_params(str(tmp_path / ".."))


# ------------------------------------------------------------------ the load curve
def test_curve_requests_are_a_few_per_client_and_the_full_list_at_the_workloads_own_count():
    w = Workload(name="x", requests=200, concurrency=50, prompt_words=(4,), max_new_tokens=(2,))
    assert [curve_requests(w, c) for c in (1, 4, 16, 50, 64)] == [16, 16, 64, 200, 200]
    small = Workload(name="y", requests=10, concurrency=3, prompt_words=(4,), max_new_tokens=(2,))
    assert [curve_requests(small, c) for c in (1, 3, 8)] == [10, 10, 10]


def test_curve_point_keeps_the_figures_of_the_table_or_the_error():
    e = {"clients": 4, "completed": 8, "errors": 0, "requests_per_s": 2.0, "output_tokens_per_s": 40.0,
         "ttft_p50": 0.1, "ttft_p90": 0.3, "tpot_p50": 0.02, "tpot_p90": 0.03, "cpu_s_per_1k_output_tokens": 9.0,
         "gflops": 12.0, "pct_of_peak": 20.0, "ttft_p99": 1.0}
    pt = curve_point(e)
    assert pt["ttft_p90"] == 0.3 and pt["pct_of_peak"] == 20.0 and "ttft_p99" not in pt
    assert curve_point({"error": "boom"}) == {"error": "boom"}


@pytest.mark.slow
def test_load_curve_runs_every_client_count_on_one_server(tmp_path, demo_model_dir):
    w = Workload(name="tiny", requests=12, concurrency=3, prompt_words=(4, 12), max_new_tokens=(3, 5),
                 unique_prompts=True, prefill_tokens=512)
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path), only=["paged"],
                  model_dir=demo_model_dir, progress=False, log=lambda m: None, clients=[1, 3], measure_peak=False)
    lengths = output_lengths(w.draw())
    pts = res["curve"]["paged"]
    assert [p["clients"] for p in pts] == [1, 3]
    # one client: a prefix of the list (curve_requests); three (the workload's own): all of it
    assert [p["completed"] for p in pts] == [curve_requests(w, 1), 12]
    head = res["strategies"]["paged"]
    assert (head["clients"], head["output_tokens"], head["errors"]) == (3, sum(lengths), 0)
    # GFLOP/s from the prompt tokens the tokenizer counts and the output tokens served
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    prompts = sum(len(tok(b["inputs"])["input_ids"]) for b in w.draw())
    assert head["prompt_tokens"] == prompts
    params = peak.count_params(demo_model_dir)
    assert head["gflops"] == pytest.approx(2 * params * (prompts + sum(lengths)) / head["duration_s"] / 1e9)
    md = markdown(res)
    assert "### Load curve: clients [1, 3]" in md and "| paged | 1 |" in md and "| paged | 3 |" in md
    assert (tmp_path / "curve.png").stat().st_size > 0


# ------------------------------------------------------------------ the real peers
_OV = openvino_peer.installed()
_LL = llamacpp_peer.installed()
# llama.cpp's converter recognises only published tokenizers (its pre-tokenizer table): the
# demo model's locally trained one is refused, so its real test serves SmolLM2-135M.
_REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     ".cache", "models", "smollm2")
_HAS_REAL = (os.path.isfile(os.path.join(_REAL, "config.json")),
             f"needs SmolLM2-135M in {_REAL} (python -m handler build-demo-model --family smollm2 {_REAL}): "
             "llama.cpp's converter refuses the demo model's locally trained tokenizer")


def _real_run(tmp_path, demo_model_dir, cells):
    w = Workload(name="tiny", requests=6, concurrency=2, prompt_words=(4, 12), max_new_tokens=(4, 8),
                 unique_prompts=True, prefill_tokens=512, kv_cache_tokens=1024)
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path), only=cells,
                  model_dir=demo_model_dir, progress=False, log=lambda m: None, measure_peak=False)
    want = sum(output_lengths(w.draw()))
    for c in cells:
        e = res["peers"][c]
        assert (e.get("errors"), e.get("output_tokens")) == (0, want), e
        assert e["ttft_p50"] is not None and e["cpu_s_per_1k_output_tokens"] > 0
        assert e["finish_reasons"] == {"length": 6}
    return res


@pytest.mark.slow
@pytest.mark.skipif(not _OV[0], reason=_OV[1])
def test_openvino_peer_answers_the_same_request_list(tmp_path, demo_model_dir):
    res = _real_run(tmp_path, demo_model_dir, ["openvino", "openvino_int8"])
    assert res["peers"]["openvino"]["started_with"]["kv_cache_tokens"] == 1024
    assert res["peers"]["openvino_int8"]["started_with"]["ir"].endswith("-int8")


@pytest.mark.slow
@pytest.mark.skipif(not _LL[0], reason=_LL[1])
@pytest.mark.skipif(not _HAS_REAL[0], reason=_HAS_REAL[1])
def test_llamacpp_peer_answers_the_same_request_list(tmp_path):
    res = _real_run(tmp_path, _REAL, ["llamacpp", "llamacpp_q8"])
    assert res["peers"]["llamacpp"]["started_with"]["kv_cache_type"] == "f32"
    assert res["peers"]["llamacpp_q8"]["started_with"]["gguf"].endswith("-q8_0.gguf")
