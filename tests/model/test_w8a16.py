"""option.quantize=int8_weight_only (W8A16, handler/model/quant.py on kernels/cpu_gemm_q4.c's 8-bit path):
the rounding, the kernel on every build against a float64 product, the model's layers, greedy parity
with `model.generate` on the same dequantized weights (every strategy, and the torch backend), the
property's names, and the quality on the real model beside W8A8's."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

from handler.config import load_config
from handler.engine.request import SamplingParams
from handler.model import quant
from handler.model.quant_int4 import TorchGroupedPack, grouped_of, is_grouped, pack
from handler.model.runner import ModelRunner
from kernels import cpu as cpu_ext
from tests.support.engine import NEW, PROMPTS, STRATEGIES, make_engine, run_all
from tests.support.kernels import each_build_fixture

each_build = each_build_fixture("gemm_q_available", "grouped-weight GEMM")


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0                      # an all-zero row: scale 0, codes 128
    w[1, 5] = 3.0                   # a row with one large weight
    return w


def test_rows_round_symmetric_with_scales_of_16_significant_bits():
    w = _weights(40, 300)
    q, s = quant.quantize_rows_w8a16(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.abs().max() <= 127
    assert s[0] == 0 and (q[0] == 0).all()
    mant = s[1:].view(torch.int32) & 0x7FFFFF
    assert (mant & 0xFF == 0).all()                        # 24 - 16 low mantissa bits clear
    exact = w.double().abs().amax(1) / 127
    assert ((s.double() - exact).abs() <= exact * 2.0 ** -16).all()
    # the error of each weight is half a step (plus the scale's own rounding, 2^-16 of max|w|)
    err = (q.double() * s.double()[:, None] - w.double()).abs()
    assert (err <= s.double()[:, None] * 0.5 + exact[:, None] * 127 * 2.0 ** -16).all()
    assert (q[1].abs().max() == 127)


def test_grouped_form_dequantizes_to_exactly_q_times_s():
    w = _weights(33, 129)
    q, s = quant.quantize_rows_w8a16(w)
    g = quant.w8a16_grouped(w)
    assert (g.bits, g.group, g.scales.shape, g.mins.shape) == (8, 129, (33, 1), (33, 1))
    # fma(q + 128, s, -128 s) is q * s: both products exact in fp32 (8 + 16 bits)
    assert torch.equal(g.dequantize(), q.float() * s[:, None])
    assert torch.equal((q.double() * s.double()[:, None]).float(), q.float() * s[:, None])


@pytest.mark.parametrize("m,n,k", [(1, 576, 576), (3, 70, 203), (13, 192, 1536), (40, 100, 64)])
def test_kernel_against_float64_of_the_dequantized_weights(each_build, m, n, k):
    w = _weights(n, k, seed=m)
    g = quant.w8a16_grouped(w)
    gen = torch.Generator().manual_seed(1)
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    got = cpu_ext.gemm_q(x, pack(g), n, b).double()
    wd = g.dequantize().double()
    want = x.double() @ wd.T + b.double()
    bound = (k + 2) * 2.0 ** -24 * (x.double().abs() @ wd.abs().T + b.double().abs())
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()
    # and against the float weights: the quantization error only (half a step per weight)
    exact = x.double() @ w.double().T + b.double()
    step = x.double().abs() @ (g.scales.double() * 0.6).expand(n, k).T
    assert ((got - exact).abs() <= step + bound).all()


def _runner(model_dir, quantize, **kw):
    return ModelRunner(model_dir, dtype="fp32", device="cpu", kv_cache_tokens=512, block_size=16,
                       quantize=quantize, **kw)


def test_the_head_is_int8_under_w8a16_unless_told_and_float_under_w8a8():
    assert quant.head_quantized("int8_weight_only") and quant.head_quantized("w8a16", "auto")
    assert not quant.head_quantized("int8") and not quant.head_quantized("int8", "auto")
    assert not quant.head_quantized("int8_weight_only", "false") and quant.head_quantized("int8", "true")


def test_the_head_follows_option_quantize_head(demo_model_dir):
    r = _runner(demo_model_dir, "int8_weight_only", fuse=False, numerics={"quantize_head": "auto"})
    head = r.model.get_output_embeddings()
    assert is_grouped(head) and head.pack.bits == 8 and head.pack.fmt == "int8_weight_only"
    # the embedding keeps its float table (a tied head is untied before quantizing)
    emb = r.model.get_input_embeddings()
    assert emb.weight.numel() > 0 and emb.weight.dtype == torch.float32
    assert not is_grouped(_runner(demo_model_dir, "int8_weight_only", fuse=False,
                                  numerics={"quantize_head": "false"}).model.get_output_embeddings())


def test_every_linear_but_the_head_is_int8_per_channel_and_unsmoothed(demo_model_dir):
    r = _runner(demo_model_dir, "int8_weight_only", fuse=False, numerics={"quantize_head": "false"})
    head = r.model.get_output_embeddings()
    body = [m for m in r.model.modules() if isinstance(m, nn.Linear) and m is not head]
    assert body and all(is_grouped(m) and m.pack.fmt == "int8_weight_only" for m in body)
    assert all(m.weight.numel() == 0 and m.pack.bits == 8 and m.pack.group == m.in_features for m in body)
    assert not is_grouped(head)
    # no SmoothQuant: the norms keep the checkpoint's weights, no layer has an input scale
    assert not any(getattr(m, "input_scale", None) is not None for m in r.model.modules())
    plain = _runner(demo_model_dir, None, fuse=False)
    n1, n2 = r.model.model.layers[0].input_layernorm, plain.model.model.layers[0].input_layernorm
    assert torch.equal(n1.weight, n2.weight)
    # each layer holds its float weight rounded per channel, in the kernel's packing or not
    for (name, m), (_, p) in zip(r.model.named_modules(), plain.model.named_modules()):
        if is_grouped(m):
            want = quant.w8a16_grouped(p.weight).dequantize()
            assert torch.equal(grouped_of(m).dequantize(), want), name


def _dequantized_dir(src: str, dst: str) -> str:
    """A float copy of `src` whose linear layers (the head too, untied; not the embeddings) hold their
    W8A16 dequantized weights: what `model.generate` runs as the reference."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    leaves = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    changed = 0
    for key in list(t):
        if key.endswith(".weight") and key.split(".")[-2] in leaves:
            t[key] = quant.w8a16_grouped(t[key]).dequantize().contiguous()
            changed += 1
    assert changed
    # the head as W8A16 serves it by default (option.quantize_head=auto): int8 per channel, its own copy
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    t["lm_head.weight"] = quant.w8a16_grouped(head).dequantize().contiguous()
    cfg["tie_word_embeddings"] = False
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    save_file(t, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def reference_dir(demo_model_factory, tmp_path_factory):
    src = demo_model_factory("qwen2")       # q/k/v biases, an intermediate size off the panel width
    return src, _dequantized_dir(src, str(tmp_path_factory.mktemp("w8a16") / "dequantized"))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_greedy_parity_with_generate_on_the_dequantized_weights(strategy, reference_dir, tmp_path):
    from tests.support.reference import hf_greedy
    src, ref = reference_dir
    engine = make_engine(src, tmp_path, {**STRATEGIES[strategy], "option.dtype": "fp32",
                                         "option.quantize": "int8_weight_only"})
    try:
        layer = engine.runner.model.model.layers[0].mlp.down_proj
        assert is_grouped(layer) and layer.pack.fmt == "int8_weight_only"
        results = run_all(engine, PROMPTS[:4], [SamplingParams(max_new_tokens=n) for n in NEW[:4]])
    finally:
        engine.shutdown()
    for p, n, (ids, _) in zip(PROMPTS, NEW, results):
        assert ids == hf_greedy(ref, p, n), (strategy, p[:20])


def test_torch_backend_serves_the_same_tokens(reference_dir, tmp_path):
    # option.cpu_kernels=torch: no C kernels, the layer dequantizes per call and torch multiplies.
    from tests.support.reference import hf_greedy
    src, ref = reference_dir
    engine = make_engine(src, tmp_path, {**STRATEGIES["paged"], "option.dtype": "fp32",
                                         "option.quantize": "w8a16", "option.cpu_kernels": "torch"})
    try:
        layer = engine.runner.model.model.layers[0].mlp.down_proj
        assert is_grouped(layer) and isinstance(layer.pack, TorchGroupedPack)
        results = run_all(engine, PROMPTS[:3], [SamplingParams(max_new_tokens=n) for n in NEW[:3]])
    finally:
        engine.shutdown()
        from kernels import cpu as ce
        ce.select(None)
    for p, n, (ids, _) in zip(PROMPTS, NEW, results):
        assert ids == hf_greedy(ref, p, n), p[:20]


@pytest.mark.parametrize("value", ["int8_weight_only", "w8a16", "int8_wo", "INT8_WEIGHT_ONLY"])
def test_the_names_select_w8a16_and_int8_stays_w8a8(demo_model_dir, tmp_path, value):
    props = tmp_path / "serving.properties"
    props.write_text(f"option.quantize={value}\n")
    assert load_config(str(props), demo_model_dir, env={}).quantize == "int8_weight_only"
    assert load_config(None, demo_model_dir, env={"HF_MODEL_QUANTIZE": value}).quantize == "int8_weight_only"
    props.write_text("option.quantize=int8\n")
    assert load_config(str(props), demo_model_dir, env={}).quantize == "int8"


def test_w8a16_quality_on_the_real_model_beside_w8a8(real_model_dir):
    """SmolLM2-135M: W8A16's perplexity within 2% of fp32's, teacher-forced agreement at least 95%, and
    at least W8A8's (its activations are not rounded); free-running agreement stated in
    benchmarks/results/quality-smollm2-135m."""
    from handler.tools import quality
    base = quality.measure(real_model_dir, "fp32", None, 32)
    w8a16 = quality.measure(real_model_dir, "fp32", "int8_weight_only", 32, reference=base["answers"])
    w8a8 = quality.measure(real_model_dir, "fp32", "int8", 32, reference=base["answers"])
    for name in quality.TEXTS:
        assert abs(w8a16["perplexity"][name] / base["perplexity"][name] - 1) <= 0.02, (name, w8a16["perplexity"])
    (s16, t16), (s8, t8) = w8a16["teacher_forced"], w8a8["teacher_forced"]
    assert t16 > 100 and s16 / t16 >= 0.95, (s16, t16)
    assert s16 / t16 >= s8 / t8, (s16 / t16, s8 / t8)
    assert w8a16["weight_bytes"] < 0.6 * base["weight_bytes"]

