"""Multi-LoRA: PEFT adapters built here (random, non-trivial B), served in mixed batches.

The oracle is PEFT itself: `merge_and_unload()` gives the base model with the adapter merged
(W + B·A·alpha/r), whose `generate` each adapter's output must equal token for token, whatever
else (other adapters, the base model) shares the batch.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from handler.config import ConfigError, load_config
from handler.engine.request import SamplingParams
from tests.support.lora import build_adapter, greedy
from tests.support.engine import make_engine, run_all as engine_run_all

PROMPTS = ["def add(a, b):", "class Stack:\n    def", "import os\nimport", "The quick brown fox",
           "for i in range(10):"]
TARGETS = {"a1": ["q_proj", "v_proj"], "a2": ["o_proj", "gate_proj", "down_proj"],
           "a3": ["k_proj", "up_proj"]}


@pytest.fixture(scope="module")
def lora_models(demo_model_factory, tmp_path_factory):
    """family -> (model dir with adapters/a1..a3, {name|None: merged model}, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    built = {}

    def make(family: str):
        if family not in built:
            src = demo_model_factory(family)
            d = str(tmp_path_factory.mktemp(f"lora-{family}") / "model")
            shutil.copytree(src, d)
            merged = {None: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()}
            for i, (name, targets) in enumerate(TARGETS.items()):
                merged[name] = build_adapter(d, os.path.join(d, "adapters", name), 100 + i, targets)
            built[family] = (d, merged, AutoTokenizer.from_pretrained(d))
        return built[family]

    return make


def run_all(engine, prompts, params_list):
    """Token ids per prompt, everything submitted at once."""
    return [ids for ids, _ in engine_run_all(engine, prompts, params_list)]


STRATEGY_PROPS = {
    "paged": {"option.rolling_batch": "auto", "option.max_rolling_batch_size": 8},
    "rolling": {"option.rolling_batch": "auto", "option.paged_attention": "false",
                "option.max_rolling_batch_size": 8},
    "dynamic": {"batch_size": 8, "max_batch_delay": 200},
}


@pytest.mark.parametrize("family, strategy", [("llama", "paged"), ("llama", "rolling"),
                                              ("qwen2", "paged"), ("qwen2", "dynamic")])
def test_mixed_adapter_batch_matches_merged_generate(family, strategy, lora_models, tmp_path):
    model_dir, merged, tok = lora_models(family)
    n = 12
    eng = make_engine(model_dir, tmp_path, {**STRATEGY_PROPS[strategy], "option.enable_lora": "true",
                                            "option.max_loras": 3, "option.dtype": "fp32",
                                            "option.device": "cpu"})
    try:
        lora = eng.runner.lora
        assert sorted(a["name"] for a in lora.list()) == ["a1", "a2", "a3"]
        # Every prompt under every adapter and the base, all submitted at once.
        names = [None, "a1", "a2", "a3"]
        jobs = [(p, name) for p in PROMPTS[:3] for name in names]
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True,
                                 adapter=None if name is None else lora.get(name)) for _, name in jobs]
        got = run_all(eng, [p for p, _ in jobs], params)
        assert eng.scheduler.stats["steps"] < len(jobs) * n   # they did share steps
    finally:
        eng.shutdown()
    differs = 0
    for (prompt, name), ids in zip(jobs, got):
        want = greedy(merged[name], tok, prompt, n)
        assert ids == want, (family, strategy, prompt, name)
        if name is not None:
            differs += want != greedy(merged[None], tok, prompt, n)
    # The adapters matter: most adapted outputs differ from the base model's.
    assert differs >= 6, differs


def test_more_adapters_than_slots_queue_and_stay_correct(lora_models, tmp_path):
    """max_loras=1: adapters take turns (slots reloaded); prefix cache never shares across them."""
    model_dir, merged, tok = lora_models("llama")
    eng = make_engine(model_dir, tmp_path, {**STRATEGY_PROPS["paged"], "option.enable_lora": "true",
                                            "option.max_loras": 1, "option.max_cpu_loras": 1,
                                            "option.enable_prefix_caching": "true",
                                            "option.block_size": 4, "option.device": "cpu",
                                            "option.dtype": "fp32"})
    try:
        lora = eng.runner.lora
        prompt = "import os\nimport sys\nimport re\n"   # several full blocks: prefix-cache candidates
        jobs = [None, "a1", "a2", "a3", "a1", None]
        params = [SamplingParams(max_new_tokens=6, ignore_eos=True,
                                 adapter=None if j is None else lora.get(j)) for j in jobs]
        got = run_all(eng, [prompt] * len(jobs), params)
        assert len(lora.cache) == 1       # max_cpu_loras=1: the others were evicted (and re-read)
    finally:
        eng.shutdown()
    for j, ids in zip(jobs, got):
        assert ids == greedy(merged[j], tok, prompt, 6), j


def test_prefix_cache_is_keyed_by_adapter():
    from handler.engine.blocks import BlockManager

    bm = BlockManager(16, 4, enable_prefix_caching=True)
    toks = list(range(13))
    bm.allocate(1, toks, len(toks), root=("lora", 7))
    bm.commit(1, toks, len(toks))
    assert bm.match(toks, ("lora", 7)) and not bm.match(toks) and not bm.match(toks, ("lora", 8))
    bm.allocate(2, toks, len(toks))
    bm.commit(2, toks, len(toks))
    assert set(bm.match(toks)).isdisjoint(bm.match(toks, ("lora", 7)))
    bm.free(1)
    bm.free(2)
    bm.check_invariants()


# ---- configuration and bad adapters
def test_lora_settings_and_env_forms(demo_model_dir):
    cfg = load_config(None, demo_model_dir, env={"OPTION_ENABLE_LORA": "true", "OPTION_MAX_LORAS": "2",
                                                 "OPTION_MAX_LORA_RANK": "32", "OPTION_MAX_CPU_LORAS": "5"})
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (True, 2, 32, 5)
    cfg = load_config(None, demo_model_dir, env={"OPTION_ENABLE_LORA": "true", "OPTION_MAX_LORAS": "6"})
    assert cfg.max_cpu_loras == 6 and cfg.max_lora_rank == 16
    cfg = load_config(None, demo_model_dir, env={"OPTION_MAX_LORAS": "2"})
    assert not cfg.enable_lora and any("option.max_loras" in w and "enable_lora" in w for w in cfg.warnings)
    with pytest.raises(ConfigError, match="option.max_cpu_loras.*>= option.max_loras=4"):
        load_config(None, demo_model_dir, env={"OPTION_ENABLE_LORA": "true", "OPTION_MAX_CPU_LORAS": "2"})
    with pytest.raises(ConfigError, match="option.max_loras=0"):
        load_config(None, demo_model_dir, env={"OPTION_ENABLE_LORA": "true", "OPTION_MAX_LORAS": "0"})


def _shapes_and_model(model_dir):
    from transformers import AutoModelForCausalLM

    from handler.model.lora import LoraManager
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return LoraManager(model, 2, 8, 2)


@pytest.mark.parametrize("case, message", [
    ("missing-weights", "missing adapter_model.safetensors"),
    ("missing-config", "missing adapter_config.json"),
    ("rank", "rank r=16 is above option.max_lora_rank=8"),
    ("target", "unknown target module 'c_attn'"),
    ("other-base", "do not fit the base layer"),
    ("no-dir", "no such directory"),
])
def test_bad_adapter_gets_one_clear_line(case, message, lora_models, tmp_path):
    from handler.model.lora import AdapterError

    model_dir, _, _ = lora_models("llama")
    good = os.path.join(model_dir, "adapters", "a1")
    bad = str(tmp_path / "bad")
    if case == "rank":
        build_adapter(model_dir, bad, 1, ["q_proj"], r=16)
    elif case != "no-dir":
        shutil.copytree(good, bad)
    if case == "missing-weights":
        os.remove(os.path.join(bad, "adapter_model.safetensors"))
    elif case == "missing-config":
        os.remove(os.path.join(bad, "adapter_config.json"))
    elif case == "other-base":    # as if trained on a model with a wider hidden size
        from safetensors.torch import load_file, save_file
        path = os.path.join(bad, "adapter_model.safetensors")
        tensors = load_file(path)
        key = next(k for k in sorted(tensors) if "lora_A" in k)
        tensors[key] = torch.cat([tensors[key], tensors[key][:, :8]], dim=1)
        save_file(tensors, path)
    elif case == "target":
        with open(os.path.join(bad, "adapter_config.json")) as f:
            cfg = json.load(f)
        cfg["target_modules"] = ["c_attn"]
        with open(os.path.join(bad, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
    manager = _shapes_and_model(model_dir)
    with pytest.raises(AdapterError) as e:
        manager.register("bad", bad)
    line = str(e.value)
    assert message in line and "'bad'" in line and "\n" not in line, line


def test_bad_adapter_directory_stops_start_up_with_one_line(lora_models, tmp_path):
    from handler.model.runner import ModelLoadError

    model_dir, _, _ = lora_models("llama")
    d = str(tmp_path / "model")
    shutil.copytree(model_dir, d)
    os.remove(os.path.join(d, "adapters", "a2", "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        make_engine(d, tmp_path, {"option.enable_lora": "true", "option.device": "cpu"})
    assert str(e.value).startswith("adapter 'a2' (") and "missing adapter_model.safetensors" in str(e.value)


# ---- over HTTP: picking an adapter, the management routes, /metrics
def adapter_metric(srv, name: str, adapter: str) -> float | None:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(srv.url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and sample.labels.get("adapter") == adapter:
                return sample.value
    return None


def test_server_adapters_by_field_header_and_openai_model_and_management_routes(lora_models, tmp_path):
    import requests

    from tests.support.server import Server

    model_dir, merged, tok = lora_models("qwen2")
    prompt, n = "def add(a, b):", 8
    want = {name: greedy(m, tok, prompt, n) for name, m in merged.items()}
    extra = str(tmp_path / "extra-adapter")
    merged_extra = build_adapter(model_dir, extra, 7, ["q_proj", "up_proj"])
    want["a4"] = greedy(merged_extra, tok, prompt, n)
    props = ("option.rolling_batch=auto\noption.enable_lora=true\noption.max_loras=2\n"
             f"option.device=cpu\noption.dtype=fp32\noption.adapter_roots={tmp_path}\n")
    srv = Server(props, model_dir, tmp_path)
    try:
        base = os.path.basename(model_dir)
        params = {"max_new_tokens": n, "details": True, "ignore_eos": True}

        def lmi(adapter=None, headers=None):
            body = {"inputs": prompt, "parameters": params}
            if adapter is not None:
                body["adapters"] = adapter
            return srv.post(body, headers=headers or {})

        def ids(r):
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["details"]["tokens"]]

        assert ids(lmi()) == want[None]
        assert ids(lmi("a1")) == want["a1"]
        assert ids(lmi(headers={"X-Amzn-SageMaker-Adapter-Identifier": "a2"})) == want["a2"]
        r = requests.post(srv.url + "/v1/completions", json={
            "model": "a3", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
            timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(want["a3"]) and r.json()["model"] == "a3"
        r = requests.post(srv.url + "/generate", json={"inputs": prompt, "parameters": {
            "adapter_id": "a1", "max_new_tokens": n, "details": True, "ignore_eos": True}}, timeout=120)
        assert r.status_code == 200 and [t["id"] for t in r.json()["details"]["tokens"]] == want["a1"], r.text
        assert want["a1"] != want[None] and want["a3"] != want[None]
        # Unknown names: a 400 naming the adapter, whichever way it was asked for.
        for r, field in ((lmi("nope"), "adapters"),
                         (lmi(headers={"X-Amzn-SageMaker-Adapter-Identifier": "nope"}),
                          "X-Amzn-SageMaker-Adapter-Identifier")):
            assert r.status_code == 400 and "nope" in r.json()["error"] and r.json()["field"] == field, r.text
        r = requests.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": prompt}, timeout=60)
        assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text
        models = requests.get(srv.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [base, "a1", "a2", "a3"]

        # Management routes (LMI's shapes): register, list, describe, use, delete, use-again fails.
        route = f"{srv.url}/models/{base}/adapters"
        r = requests.post(route, params={"name": "a4", "src": extra}, timeout=60)
        assert r.status_code == 200 and r.json() == {"status": "Adapter a4 registered"}, r.text
        listed = requests.get(route, timeout=30).json()["adapters"]
        assert {a["name"]: a["src"] for a in listed}["a4"] == extra
        assert requests.get(route + "/a4", timeout=30).json() == [{"name": "a4", "src": extra, "pin": False}]
        assert ids(lmi("a4")) == want["a4"]
        r = requests.post(route, params={"name": "a4", "src": extra}, timeout=60)
        assert r.status_code == 409, r.text
        r = requests.delete(route + "/a4", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "Adapter a4 unregistered"}, r.text
        r = lmi("a4")
        assert r.status_code == 400 and "a4" in r.json()["error"], r.text
        assert requests.delete(route + "/a4", timeout=30).status_code == 404
        r = requests.post(route, params={"name": "bad", "src": str(tmp_path / "none")}, timeout=60)
        assert r.status_code == 400 and r.json()["error"].startswith("adapter 'bad' (") \
            and "no such directory" in r.json()["error"], r.text
        # Outside <model dir>/adapters/ and option.adapter_roots: one 403, existing or not.
        for src in ("/etc", "/no/such/dir", "../../"):
            r = requests.post(route, params={"name": "bad", "src": src}, timeout=60)
            assert r.status_code == 403 and "is not allowed" in r.json()["error"], r.text
        assert requests.get(f"{srv.url}/models/other/adapters", timeout=30).status_code == 404
        # The base model still answers as before.
        assert ids(lmi()) == want[None]
        assert adapter_metric(srv, "lmi_adapter_requests_total", "a1") == 2   # LMI and TGI above
        assert adapter_metric(srv, "lmi_adapter_generated_tokens_total", "a4") == n
        # bench's mixed-adapter traffic: request i asks for adapter i mod 4 ("-": the base).
        import subprocess
        import sys
        out = subprocess.run([sys.executable, "-m", "handler", "bench", "run", "--url", srv.url,
                              "--preset", "smoke", "--workload", "smoke", "--requests", "8",
                              "--max-new-tokens", "4", "--adapters", "a1,a2,a3,-", "--no-progress"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "8/8 ok" in out.stdout, out.stdout + out.stderr
        assert adapter_metric(srv, "lmi_adapter_requests_total", "a1") == 4   # 2 above + 2 here
        assert adapter_metric(srv, "lmi_adapter_requests_total", "a3") == 3   # 1 above + 2 here
    finally:
        srv.stop()


def test_lmi_adapters_field_parsing():
    from handler.http.protocols.lmi import parse

    gen = parse({"inputs": "x", "adapters": "a1"})
    assert gen.adapter == "a1"
    gen = parse({"inputs": ["x", "y"], "adapters": ["a1", "a1"]})
    assert gen.adapter == "a1"
    gen = parse({"inputs": "x", "parameters": {"adapter_id": "a2"}})     # TGI's parameter
    assert (gen.adapter, gen.adapter_field) == ("a2", "parameters.adapter_id")
    assert parse({"inputs": "x", "adapters": "a1", "parameters": {"adapter_id": "a2"}}).adapter == "a1"
    from handler.engine.request import RequestError
    for bad in ({"inputs": ["x", "y"], "adapters": ["a1", "a2"]}, {"inputs": ["x"], "adapters": ["a", "a"]},
                {"inputs": "x", "adapters": 3}, {"inputs": "x", "parameters": {"adapter_id": 3}}):
        with pytest.raises(RequestError) as e:
            parse(bad)
        assert e.value.field in ("adapters", "parameters.adapter_id")


def test_adapter_without_lora_enabled_is_a_400_naming_the_setting(demo_model_dir):
    """Without option.enable_lora an adapter request must not silently run the base model."""
    from types import SimpleNamespace

    from handler.http.app import ServerState, create_app

    state = ServerState(load_config(None, demo_model_dir, env={}))
    state.engine = SimpleNamespace(runner=SimpleNamespace(lora=None), tokenizer=None, healthy=True)
    client = create_app(state).test_client()
    r = client.post("/invocations", json={"inputs": "x", "adapters": "a1"})
    assert r.status_code == 400 and r.json["field"] == "adapters" and "option.enable_lora" in r.json["error"]
    r = client.post("/invocations", json={"inputs": "x"}, headers={"X-Amzn-SageMaker-Adapter-Identifier": "a1"})
    assert r.status_code == 400 and r.json["field"] == "X-Amzn-SageMaker-Adapter-Identifier"
    r = client.get(f"/models/{os.path.basename(demo_model_dir)}/adapters")
    assert r.status_code == 400 and "option.enable_lora" in r.json["error"]


def test_demo_adapters_load_in_peft_and_match_the_engine(demo_model_factory, tmp_path):
    """build-demo-model --adapters writes what PEFT itself reads; our output equals PEFT's merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from handler.tools.demo_model import build_demo_adapters

    d = str(tmp_path / "model")
    shutil.copytree(demo_model_factory("llama"), d)
    names = build_demo_adapters(d, 2, rank=4)
    assert names == ["demo-1", "demo-2"]
    tok = AutoTokenizer.from_pretrained(d)
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, os.path.join(d, "adapters", "demo-2")).merge_and_unload().eval()
    eng = make_engine(d, tmp_path, {"option.enable_lora": "true", "option.device": "cpu",
                                    "option.dtype": "fp32"})
    try:
        prompt = "def add(a, b):"
        [got] = run_all(eng, [prompt], [SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                       adapter=eng.runner.lora.get("demo-2"))])
    finally:
        eng.shutdown()
    base_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert got == greedy(merged, tok, prompt, 8) != greedy(base_model, tok, prompt, 8)


def test_scheduler_runs_at_most_max_loras_adapters_at_once():
    """A sequence for a third adapter waits (in order) until one of the two running ones ends;
    base-model sequences are never held back."""
    from types import SimpleNamespace

    from handler.engine.blocks import BlockManager
    from handler.engine.scheduler import Scheduler, SchedulerPolicy, Sequence

    sched = Scheduler(SchedulerPolicy("paged", max_loras=2), BlockManager(64, 4))
    a, b, c = (SimpleNamespace(name=n, uid=i) for i, n in enumerate("abc"))
    for sid, adapter in enumerate([a, b, a, c, None], start=1):
        sched.add(Sequence(sid, [1, 2, 3], SamplingParams(max_new_tokens=4, adapter=adapter), 0.0))
    plan = sched.schedule(0.0)
    assert [it.seq_id for it in plan.items] == [1, 2, 3]    # c (4) waits, and the base (5) behind it
    assert {it.params.adapter.name for it in plan.items} == {"a", "b"}
    sched.finish(2, "aborted")                              # b ends: c may run, then the base
    plan = sched.schedule(0.0)
    assert sorted(it.seq_id for it in plan.items) == [1, 3, 4, 5]
