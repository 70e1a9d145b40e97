"""The MoE benchmark's model (benchmarks/moe_q4km.py: Qwen3-30B-A3B's shape with random weights, as the
Hub lays its checkpoint out) and its preset (workloads.py `cpu-moe-30b-a3b`)."""
from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from handler.tools.bench.compare import prepare_model
from handler.tools.bench.workloads import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("moe_q4km", os.path.join(ROOT, "benchmarks", "moe_q4km.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shape_is_qwen3_30b_a3b_and_its_tensors_are_the_hubs(demo_model_dir, tmp_path):
    s = _script()
    c = s.SHAPE
    assert (c["hidden_size"], c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
            c["num_attention_heads"], c["num_key_value_heads"]) == (2048, 128, 8, 768, 32, 4)
    # the 48-layer count of its tensors' elements: Qwen3-30B-A3B's published 30,532,122,624 parameters
    full = {**c, "num_hidden_layers": 48}
    assert sum(math.prod(shape) for _, shape, _ in s.tensors(full)) == 30_532_122_624
    # a tiny config of the same family written by the script loads in transformers (no key missing or
    # left over) and in our own implementation (whose loader checks every expert of every layer)
    import transformers
    demo = json.load(open(os.path.join(demo_model_dir, "config.json")))
    tiny = {**c, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "vocab_size": demo["vocab_size"], "bos_token_id": demo.get("bos_token_id"),
            "eos_token_id": demo.get("eos_token_id"), "torch_dtype": "float32"}
    d = s.write_checkpoint(tiny, str(tmp_path / "hf"), tokenizer_dir=demo_model_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(demo_model_dir, f)):
            assert os.path.isfile(os.path.join(d, f))
    _, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    from handler.model.runner import ModelRunner
    r = ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=64)
    assert r.own and r.model.arch.moe.experts == 4


def test_the_preset_needs_the_scripts_model(tmp_path):
    p = PRESETS["cpu-moe-30b-a3b"]
    assert p.clients == (1, 16) and p.one_at_a_time
    with pytest.raises(ValueError, match="benchmarks/moe_q4km.py"):
        prepare_model(p, str(tmp_path))
