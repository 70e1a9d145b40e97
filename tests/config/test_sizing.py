"""The sizing rules (handler/config/sizing.py), shared by the runner, `config --explain`, `serve`,
the HTTP layer and `tune`: by hand, and the same answers through each caller's name for them."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from handler.config import explain, hardware, sizing
from handler.engine.request import SamplingParams

PY = sys.executable


def test_geometry_by_hand_from_json_and_objects(tmp_path):
    llama = dict(model_type="llama", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 hidden_size=256, max_position_embeddings=1024, torch_dtype="bfloat16")
    assert sizing.geometry(llama) == sizing.Geometry("llama", 4, 2, 32, 1024, "bf16")
    gpt2 = dict(model_type="gpt2", n_layer=3, n_head=6, n_embd=192, n_positions=512)
    assert sizing.geometry(gpt2) == sizing.Geometry("gpt2", 3, 6, 32, 512, None)
    # Falcon: one shared KV head (multi_query), or num_kv_heads with the new decoder architecture
    falcon = dict(model_type="falcon", num_hidden_layers=2, num_attention_heads=8, hidden_size=64, multi_query=True)
    assert sizing.geometry(falcon).kv_heads == 1
    assert sizing.geometry(dict(falcon, new_decoder_architecture=True, num_kv_heads=4)).kv_heads == 4
    assert sizing.geometry(dict(falcon, multi_query=False)).kv_heads == 8
    # multimodal configs nest the decoder; a config object reads the same
    assert sizing.geometry({"model_type": "llava", "text_config": llama}).layers == 4
    obj = SimpleNamespace(model_type="llama", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=None,
                          hidden_size=256, max_position_embeddings=None, dtype="float32")
    assert sizing.geometry(obj) == sizing.Geometry("llama", 4, 8, 32, sizing.DEFAULT_MAX_POSITIONS, "fp32")
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        sizing.geometry({"model_type": "bert_ish"}, "x/config.json")
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(falcon, architectures=["FalconForCausalLM"])))
    assert sizing.read_heads(str(d)) == ("FalconForCausalLM", 8, 1)
    assert explain.read_geometry(str(d)) == sizing.read_geometry(str(d))


def test_falcon_geometry_matches_transformers():
    from transformers import FalconConfig

    from handler.model.runner import model_geometry
    for kw in (dict(multi_query=True), dict(multi_query=False),
               dict(new_decoder_architecture=True, num_kv_heads=2)):
        c = FalconConfig(num_hidden_layers=2, num_attention_heads=8, hidden_size=64, **kw)
        g = sizing.geometry(json.loads(c.to_json_string()))
        assert model_geometry(c) == (g.layers, g.kv_heads, g.head_dim, g.max_positions), kw


def test_dtype_and_device_rules():
    assert sizing.resolve_dtype("auto", "cpu") == "fp32"
    assert sizing.resolve_dtype("auto", "cuda") == "bf16"
    assert sizing.resolve_dtype("auto", "cuda", bf16_supported=False) == "fp16"
    assert sizing.resolve_dtype("fp16", "cpu") == "fp16"
    assert sizing.resolve_device("auto", cuda_visible=True) == "cuda"
    assert sizing.resolve_device("auto", cuda_visible=False) == "cpu"
    assert sizing.resolve_device("cpu", cuda_visible=True) == "cpu"


def test_the_runner_and_explain_pick_the_same_dtype_and_device():
    import torch

    from handler.model.runner import DTYPES, pick_device, pick_dtype
    for device in ("auto", "cpu"):
        dev = pick_device(device)
        assert dev.type == explain.resolve_device(device) == hardware.pick_device(device)
        for dtype in ("auto", "fp32", "fp16", "bf16"):
            assert pick_dtype(dtype, dev) == DTYPES[explain.resolve_dtype(dtype, dev.type)]
    if not torch.cuda.is_available():   # planning for a GPU from a CPU host: bf16
        assert explain.resolve_dtype("auto", "cuda") == "bf16"


def test_kv_budget_by_hand():
    per_tok = 4096
    # CPU: every running sequence at full length, within the memory's budget, at least one block
    gib = 1 << 30
    assert sizing.default_kv_tokens(per_tok, 8 * 1024, 16, "cpu", available=8 * gib) == 8 * 1024
    assert sizing.default_kv_tokens(per_tok, 10 ** 9, 16, "cpu", available=8 * gib) == \
        (int(8 * gib * 0.7) - (512 << 20)) // per_tok
    assert sizing.default_kv_tokens(10 ** 12, 100, 16, "cpu", available=8 * gib) == 16
    # CUDA: utilization x total - used - 1 GiB
    assert sizing.kv_budget_bytes("cuda", 0.5, 8 * gib, used=gib) == 2 * gib
    assert sizing.default_kv_tokens(per_tok, 10 ** 9, 16, "cuda", 0.5, 8 * gib, used=gib) == 2 * gib // per_tok
    assert sizing.default_kv_tokens(per_tok, 100, 16, "cuda", 0.5, 8 * gib, used=gib) == 100
    g = sizing.Geometry("llama", 4, 4, 32, 1024, None)
    assert sizing.kv_bytes_per_token(g, "bf16") == 2 * 4 * 4 * 32 * 2
    assert sizing.kv_bytes_per_token(g, "bf16", tp=2) == 2 * 4 * 2 * 32 * 2


def test_explain_gpu_estimate_is_capped_like_the_runner(tmp_path):
    from handler.config import load_config
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(model_type="llama", num_hidden_layers=4, num_attention_heads=8,
                                                   hidden_size=256, max_position_embeddings=1024)))
    (tmp_path / "p").write_text("option.rolling_batch=auto\noption.max_rolling_batch_size=4\n")
    cfg = load_config(str(tmp_path / "p"), str(d), env={}, check_model=False, gpu_count=0)
    e = explain.explain(cfg, sizing.read_geometry(str(d)), device="cuda", gpu_memory_gib=80, model_dir=str(d))
    assert e["kv_cache_tokens"] == 4 * 1024 and e["kv_cache_source"].startswith("default: 4 running sequences")
    # 1.12 GiB x 0.9 - 1 GiB (no weights) holds fewer than 4 x 1024 tokens of 4 KiB: the estimate governs
    e = explain.explain(cfg, sizing.read_geometry(str(d)), device="cuda", gpu_memory_gib=1.12, model_dir=str(d))
    tokens = (int(int(1.12 * (1 << 30)) * 0.9) - (1 << 30)) // (2 * 4 * 8 * 32 * 2)
    assert 16 < tokens < 4 * 1024
    assert e["kv_cache_tokens"] == -(-tokens // 16) * 16 and e["kv_cache_source"].startswith("estimate: 1.12 GiB")


@pytest.mark.parametrize("strategy, width", [("none", 1), ("dynamic", 8), ("rolling", 32), ("paged", 32)])
def test_running_width_is_one_rule_everywhere(strategy, width):
    from handler.http.app import running_width
    from handler.server import _width
    cfg = SimpleNamespace(strategy=strategy, batch_size=8, max_rolling_batch_size=32)
    assert sizing.running_width(cfg) == running_width(cfg) == _width(cfg) == explain.batch_width(cfg) == width


def test_expected_ideal_speedup_lives_in_sizing():
    from handler.tools.bench import metrics
    assert metrics.expected_ideal_speedup is sizing.expected_ideal_speedup
    assert sizing.expected_ideal_speedup([1, 3], 2) == pytest.approx(2.5 / 2)


def test_config_sizing_imports_no_torch():
    probe = ("import sys\nfrom handler.config import explain, hardware, schema, sizing, switches, docs\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "import glob\n"
             "if not any(glob.glob(p) for p in hardware._DEVICE_NODES):\n"
             "    assert hardware.pick_device('auto') == 'cpu' and hardware.pick_dtype('auto', 'cuda') == 'bf16'\n"
             "    assert 'torch' not in sys.modules, 'torch imported by a probe on a host without GPUs'\n")
    r = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ CPU memory
def _fake_memory(tmp_path, meminfo_kb: int, cgroup: tuple[str, str] | None):
    (tmp_path / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {meminfo_kb} kB\n")
    root = tmp_path / "cg"
    root.mkdir()
    if cgroup is not None:
        (root / "memory.max").write_text(cgroup[0] + "\n")
        (root / "memory.current").write_text(cgroup[1] + "\n")
    return str(root), str(tmp_path / "meminfo")


def test_cpu_memory_is_the_cgroup_room_when_limited_else_memavailable(tmp_path):
    gib = 1 << 30
    root, mi = _fake_memory(tmp_path, 16 * gib // 1024, (str(3 * gib), str(gib)))
    assert hardware.cpu_available_memory(root, mi) == 2 * gib          # 3 GiB limit - 1 GiB used
    (tmp_path / "cg" / "memory.max").write_text("max\n")                # no limit: MemAvailable
    assert hardware.cpu_available_memory(root, mi) == 16 * gib
    (tmp_path / "cg" / "memory.max").write_text(str(64 * gib))          # a limit above the host's
    assert hardware.cpu_available_memory(root, mi) == 16 * gib
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 * gib))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(gib // 2))
    assert hardware.cpu_available_memory(str(v1), mi) == 3 * gib // 2


def test_cpu_kv_budget_follows_the_memory_not_a_fixed_4_gib():
    gib, per_tok = 1 << 30, 4096
    # 70 % of (available - weights) - 512 MiB
    assert sizing.cpu_kv_budget(4 * gib, gib) == int(3 * gib * 0.7) - (512 << 20)
    assert sizing.cpu_kv_budget(gib // 2) == 0
    assert sizing.default_kv_tokens(per_tok, 10 ** 9, 16, "cpu", available=2 * gib) == \
        (int(2 * gib * 0.7) - (512 << 20)) // per_tok
    assert sizing.default_kv_tokens(per_tok, 10 ** 9, 16, "cpu", available=64 * gib) > (4 << 30) // per_tok
    assert sizing.default_kv_tokens(per_tok, 10 ** 9, 16, "cpu", available=0) == 16   # one block at least


def test_explain_and_the_runner_size_the_cpu_pool_from_the_same_cgroup_limit(tmp_path, monkeypatch,
                                                                               demo_model_dir):
    """The tiny model under a fake 2 GiB cgroup: the runner's pool and `config --explain`'s agree
    (the runner counts the weights as used, explain subtracts them), both far below what the
    batch wants, and a request longer than the pool is refused with 400, not an OOM kill."""
    import torch

    from handler.config import load_config
    from handler.model.runner import ModelRunner
    gib = 1 << 30
    root, mi = _fake_memory(tmp_path, 64 * gib // 1024, (str(2 * gib), str(300 << 20)))
    monkeypatch.setenv("LMI_CGROUP_ROOT", root)
    monkeypatch.setenv("LMI_MEMINFO", mi)
    (tmp_path / "p").write_text("option.rolling_batch=auto\noption.max_rolling_batch_size=256\n"
                                "option.max_model_len=4096\n")
    cfg = load_config(str(tmp_path / "p"), demo_model_dir, env={}, gpu_count=0)
    g = sizing.read_geometry(demo_model_dir)
    e = explain.explain(cfg, g, device="cpu", model_dir=demo_model_dir)
    per_tok = e["kv_bytes_per_token"]
    wb = explain.weights_bytes(demo_model_dir, g, "fp32")
    assert e["cpu_kv_budget_bytes"] == int((2 * gib - (300 << 20) - wb) * 0.7) - (512 << 20)
    assert e["kv_cache_tokens"] < 256 * 4096 and "capped by the CPU memory" in e["kv_cache_source"]
    # The runner, after loading the weights: memory.current now counts them.
    (tmp_path / "cg" / "memory.current").write_text(str((300 << 20) + wb))
    runner = ModelRunner(demo_model_dir, dtype="fp32", device="cpu", block_size=16, kv_cache_tokens=None,
                         max_running=256, max_model_len=4096)
    assert runner.kv.tokens == e["kv_cache_tokens"]
    assert runner.kv.tokens * per_tok <= 2 * gib - (300 << 20) - wb
    # A request longer than that pool: refused before it runs (the HTTP layer's 400).
    from handler.engine.scheduler import CapacityError
    from handler.server import engine_for
    engine = engine_for(cfg, runner)
    try:
        with pytest.raises(CapacityError, match="KV|cache|tokens"):
            engine.submit([[1] * (runner.kv.tokens + 1)], SamplingParams(max_new_tokens=1))
    finally:
        engine.shutdown()
    del runner, torch
