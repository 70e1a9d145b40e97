"""Issue 14's benchmark pieces: the 135M preset's unique, token-sized prompts; the OpenAI
completions adapter (driven against our own /v1/completions, checked against the LMI path);
CPU-seconds of a process tree; the vLLM CPU peer's KV sizing, its skip-with-reason path, and
(only where the peer venv exists) a real vLLM run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from handler.tools.bench import vllm_cpu
from handler.tools.bench.client import LMI, OpenAICompletions, run_load
from handler.tools.bench.compare import compare, properties
from handler.tools.bench.cputime import TreeCpu
from handler.tools.bench.workloads import PRESETS, Preset, Workload, output_lengths, prompt_of

from tests.support.server import Server


# ------------------------------------------------------------------ prompts
@pytest.fixture(scope="module")
def tok_135m():
    """The tokenizer the cpu-135m preset's model carries (materialise_random's: the demo
    tokenizer trained for SmolLM's 49,152-token vocabulary)."""
    from handler.tools.demo_model import build_tokenizer

    return build_tokenizer(49152)


def test_135m_prompts_are_unique_and_have_the_token_lengths_asked(tok_135m):
    w = PRESETS["cpu-135m"].workloads[0]
    assert (w.requests, w.concurrency, w.max_new_tokens, w.kv_cache_tokens, w.max_rolling_batch_size,
            w.prefill_tokens) == (200, 50, (16, 32, 64), 12800, 64, 4096)
    bodies = w.draw(tok_135m)
    ids = [tok_135m(b["inputs"])["input_ids"] for b in bodies]
    by_target = {t: [] for t in (15, 60, 160)}
    for x in ids:
        target = max(t for t in by_target if len(x) >= t)
        by_target[target].append(len(x))
    for t, lengths in by_target.items():
        assert lengths, f"no prompt of about {t} tokens drawn"
        assert max(lengths) <= t + 4, (t, sorted(set(lengths)))     # at least t, under a word more
    # no two prompts share even their first 16-token block: no prefix-cache hit is possible
    assert len({tuple(x[:16]) for x in ids}) == len(ids)
    assert all(b["parameters"]["ignore_eos"] and b["stream"] for b in bodies)
    assert w.draw(tok_135m) == bodies                                   # the same list every time


def test_chat_workload_wraps_varied_instructions_in_the_template_and_honours_eos(demo_model_dir):
    from transformers import AutoTokenizer

    from handler.tools.bench.workloads import INSTRUCTIONS, TOPICS

    tok = AutoTokenizer.from_pretrained(demo_model_dir)       # the demo model has a chat template
    w = next(w for w in PRESETS["cpu-135m"].workloads if w.name == "chat")
    bodies = w.draw(tok)
    assert len(bodies) == w.requests and w.draw(tok) == bodies
    instructions = [tok.apply_chat_template([{"role": "user", "content": i.format(topic=t)}], tokenize=False,
                                            add_generation_prompt=True) for i in INSTRUCTIONS for t in TOPICS]
    assert all(b["inputs"] in instructions for b in bodies)
    lengths = {len(tok(b["inputs"])["input_ids"]) for b in bodies}
    assert max(lengths) > 3 * min(lengths)                  # short questions and long requests
    assert not any(b["parameters"]["ignore_eos"] for b in bodies)
    with pytest.raises(ValueError, match="chat template"):
        w.draw()


def test_token_sized_workload_needs_a_tokenizer():
    with pytest.raises(ValueError, match="sizes its prompts in tokens"):
        PRESETS["cpu-135m"].workloads[0].draw()


def test_old_presets_keep_their_shared_prompts():
    for preset in ("cpu", "smoke"):
        for w in PRESETS[preset].workloads:
            assert {b["inputs"] for b in w.draw()} <= {prompt_of(n) for n in w.prompt_words}


def test_materialised_135m_config_is_smollm_shape():
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(os.path.join(vllm_cpu.REPO, "benchmarks", "configs", "smollm-135m"))
    assert (c.architectures, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings, c.max_position_embeddings) == \
        (["LlamaForCausalLM"], 576, 1536, 30, 9, 3, 49152, True, 2048)


# ------------------------------------------------------------------ the OpenAI adapter
def test_openai_completions_adapter_matches_the_lmi_path_on_our_server(tmp_path, demo_model_dir):
    """Our server also serves /v1/completions: the same request list through both adapters
    gives the same output token counts and finish reasons, and both time a first token."""
    w = Workload(name="t", requests=8, concurrency=3, prompt_words=(4, 12), max_new_tokens=(3, 7),
                 eos_after=None, unique_prompts=True)
    bodies = w.draw()
    props = properties("paged", w, 1024, "fp32")
    srv = Server(props, demo_model_dir, tmp_path)
    try:
        api = OpenAICompletions("whatever")
        lmi, _ = run_load(LMI.url(srv.url), bodies, 3, progress=False)
        oai, _ = run_load(api.url(srv.url), bodies, 3, progress=False, api=api)
        # eos_after through the adapter: max_tokens = min(K, max), reported as eos_token
        k_body = dict(bodies[0], parameters=dict(bodies[0]["parameters"], eos_after=2))
        (k_rec,), _ = run_load(api.url(srv.url), [k_body], 1, progress=False, api=api)
        # not streamed: one JSON body with usage
        (plain,), _ = run_load(api.url(srv.url), [dict(bodies[1], stream=False)], 1, progress=False, api=api)
    finally:
        srv.stop()
    assert [r.error for r in lmi + oai] == [None] * 16
    assert [r.tokens for r in oai] == [r.tokens for r in lmi] == output_lengths(bodies)
    assert [r.finish_reason for r in oai] == [r.finish_reason for r in lmi] == ["length"] * 8
    assert all(r.ttft is not None and 0 < r.ttft <= r.latency for r in oai)
    assert (k_rec.error, k_rec.tokens, k_rec.finish_reason) == (None, 2, "eos_token")
    assert (plain.error, plain.tokens, plain.ttft) == (None, bodies[1]["parameters"]["max_new_tokens"], None)


def test_openai_body_carries_the_held_equal_settings():
    b = {"inputs": "hi", "parameters": {"max_new_tokens": 9, "ignore_eos": True, "details": True},
         "stream": True}
    assert OpenAICompletions("m").body(b) == {
        "model": "m", "prompt": "hi", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}


# ------------------------------------------------------------------ CPU seconds
_TREE = textwrap.dedent("""
    import os, subprocess, sys, time
    d = sys.argv[1]
    def burn(seconds):
        t = time.process_time()
        while time.process_time() - t < seconds:
            pass
    def note(name, value):
        with open(os.path.join(d, name + ".tmp"), "w") as f:
            f.write(repr(value))
        os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name))
    def wait_for(name):
        while not os.path.exists(os.path.join(d, name)):
            time.sleep(0.02)
    if len(sys.argv) > 2:                      # a child: burn, report its own CPU time, linger
        burn(float(sys.argv[2]))
        note(sys.argv[3], time.process_time())
        time.sleep(float(sys.argv[4]))
        sys.exit(0)
    burn(0.4)                                  # before the measurement: must not count
    note("root_before", time.process_time())
    wait_for("go")
    a = subprocess.Popen([sys.executable, __file__, d, "0.8", "a", "1.2"])  # dies mid-run
    a.wait()
    subprocess.Popen([sys.executable, __file__, d, "0.5", "b", "30"])       # still alive at the end
    burn(0.3)
    note("root_after", time.process_time())
    time.sleep(30)
""")


def test_tree_cpu_counts_every_process_of_the_tree_over_the_block(tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(_TREE)
    root = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True)
    try:
        def wait_for(name, timeout=60):
            deadline = time.monotonic() + timeout
            while not (tmp_path / name).exists():
                assert time.monotonic() < deadline, f"{name} never written"
                time.sleep(0.02)
            return float((tmp_path / name).read_text())

        before = wait_for("root_before")
        with TreeCpu(root.pid, interval=0.2) as m:
            (tmp_path / "go").write_text("")
            a, b, after = wait_for("a"), wait_for("b"), wait_for("root_after")
            time.sleep(0.3)
        # each process's own clock (CLOCK_PROCESS_CPUTIME_ID), not psutil's /proc reading
        want = (after - before) + a + b
        assert m.seconds == pytest.approx(want, abs=0.12), (m.seconds, want)
        assert m.processes == 3
    finally:
        os.killpg(root.pid, 9)
        root.wait()


# ------------------------------------------------------------------ the vLLM CPU peer
def test_kv_bytes_per_token_is_what_a_kv_cache_holds(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2)
    cfg.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.arange(10)[None], past_key_values=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert vllm_cpu.kv_bytes_per_token(str(tmp_path), "fp32") * 10 == held
    assert vllm_cpu.kv_bytes_per_token(str(tmp_path), "bf16") * 2 == vllm_cpu.kv_bytes_per_token(str(tmp_path), "fp32")


def test_vllm_server_is_started_with_equal_settings(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30,
        "max_position_embeddings": 2048}))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    cmd, env, held = vllm_cpu.server("/peer", str(tmp_path), 1234, 12800, 64, 4096, "bf16")
    flag = lambda f: cmd[cmd.index(f) + 1]  # noqa: E731
    # 100 usable blocks of 128 tokens + the null block vLLM holds back
    assert flag("--kv-cache-memory-bytes") == str((12800 + 128) * 2 * 30 * 3 * 64 * 2)
    assert (flag("--max-num-seqs"), flag("--max-num-batched-tokens"), flag("--dtype"), flag("--block-size"),
            flag("--model"), flag("--max-model-len")) == ("64", "4096", "bfloat16", "128", str(tmp_path), "2048")
    assert "--no-enable-prefix-caching" in cmd
    assert env["VLLM_CPU_KVCACHE_SPACE"] is None            # removed: it would override the bytes
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_cpu.omp_bind()
    assert held["kv_cache_tokens"] == 12800 and held["prefix_caching"] is False
    # a capacity that is not whole 128-token blocks rounds up to them
    assert vllm_cpu.server("/peer", str(tmp_path), 1, 96, 2, 512, "fp32")[2]["kv_cache_tokens"] == 128
    assert vllm_cpu.omp_bind([0, 1, 2, 3]) == "0-3" and vllm_cpu.omp_bind([0, 2, 3]) == "0,2,3"


def test_absent_vllm_peer_is_skipped_with_the_reason(tmp_path, demo_model_dir):
    logs = []
    w = Workload(name="tiny", requests=2, concurrency=1, prompt_words=(4,), max_new_tokens=(2,))
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path), only=["vllm_cpu"],
                  model_dir=demo_model_dir, progress=False, log=logs.append,
                  vllm_dir=str(tmp_path / "no-such-venv"))
    reason = res["peers"]["vllm_cpu"]["skipped"]
    assert reason.startswith("vLLM CPU peer not installed (python -m handler bench install-peer vllm)")
    assert any("vllm_cpu skipped: vLLM CPU peer not installed" in m for m in logs)
    md = (tmp_path / "results.md").read_text()
    assert "| vllm_cpu (peer) | skipped: vLLM CPU peer not installed (python -m handler bench install-peer vllm)" in md


def test_cli_installs_nothing_for_an_unknown_peer(capsys):
    from handler.tools.bench import cli

    with pytest.raises(SystemExit):
        cli.main(["install-peer", "sglang"])
    assert "invalid choice: 'sglang'" in capsys.readouterr().err


_VLLM = vllm_cpu.installed()
needs_vllm = pytest.mark.skipif(not _VLLM[0], reason=_VLLM[1])


@pytest.mark.vllm
@needs_vllm
def test_vllm_accepts_every_flag_we_pass(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 2, "hidden_size": 8, "num_hidden_layers": 1}))
    cmd, env, _ = vllm_cpu.server(_VLLM[1], str(tmp_path), 1, 128, 2, 512, "fp32")
    text = subprocess.run(cmd[:3] + ["--help=all"], capture_output=True, text=True, timeout=300).stdout
    for f in (x for x in cmd if x.startswith("--")):
        assert f in text, f


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllm_peer_answers_the_same_request_list(tmp_path, demo_model_dir):
    w = Workload(name="tiny", requests=6, concurrency=2, prompt_words=(4, 12), max_new_tokens=(4, 8),
                 unique_prompts=True, prefill_tokens=512)
    res = compare(Preset("tiny", (w,), repetitions=1, model="demo"), str(tmp_path), only=["paged", "vllm_cpu"],
                  model_dir=demo_model_dir, progress=False, log=lambda m: None)
    want = sum(output_lengths(w.draw()))
    for e in (res["strategies"]["paged"], res["peers"]["vllm_cpu"]):
        assert (e.get("errors"), e.get("output_tokens")) == (0, want), e
        assert e["ttft_p50"] is not None and e["cpu_s_per_1k_output_tokens"] > 0
    assert res["peers"]["vllm_cpu"]["started_with"]["prefix_caching"] is False
