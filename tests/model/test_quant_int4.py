"""Grouped 4/8-bit weights (handler/model/quant_int4.py, quant_formats.py, kernels/cpu_gemm_q4.c):
the kernel against a float64 product of the dequantized weights, AWQ/GPTQ/GGUF unpacking against
independent unpackers written here from the formats' descriptions, checkpoints of a tiny model
served with the greedy tokens of an fp32 model built from their dequantized weights, the config
checks, and the real model's AWQ / GPTQ / Q4_1 served with parity."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from handler.config import ConfigError, load_config
from handler.engine.request import SamplingParams
from handler.model import quant_formats as qf
from handler.model.quant_int4 import Grouped, QuantLoadError, grouped_linear, grouped_of, is_grouped, pack
from kernels import cpu as cpu_ext
from tests.support.kernels import each_build_fixture, both_x86
from tests.support.engine import NEW, PROMPTS, STRATEGIES, make_engine, run_all

needs_kernel = pytest.mark.skipif(not cpu_ext.gemm_q_available(),
                                  reason="kernels/cpu_gemm_q4.c does not run here (no avx512/avx2/neon kernel "
                                         "build for this CPU, or no C compiler)")


each_build = each_build_fixture("gemm_q_available", "grouped-weight GEMM")
AWQ_ORDER_DOC = [0, 2, 4, 6, 1, 3, 5, 7]


def _grouped(n, k, g, bits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // g)
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen).to(torch.uint8)
    s = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half().float()     # fp16 scales, as stored
    z = torch.randint(0, 2 ** bits, (n, groups), generator=gen).float()
    return Grouped(q, s, -z * s, bits, g)


# ---------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("m,n,k,g,bits", [(1, 576, 576, 64, 4), (7, 33, 70, 32, 4), (13, 192, 129, 128, 4),
                                          (64, 100, 96, 16, 4), (5, 40, 100, 32, 8), (30, 1536, 576, 32, 4),
                                          (3, 50, 77, 7, 8), (4, 65, 200, 128, 4)])
def test_kernel_against_float64_of_the_dequantized_weights(each_build, m, n, k, g, bits):
    w = _grouped(n, k, g, bits, seed=m)
    gen = torch.Generator().manual_seed(1)
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    got = cpu_ext.gemm_q(x, pack(w), n, b).double()
    wd = w.dequantize().double()
    want = x.double() @ wd.T + b.double()
    # fp32 summation of k products: |error| <= k * 2^-24 * sum|x w| (+ the bias's rounding); a wrong
    # code, scale or group is off by the size of the terms themselves
    bound = (k + 2) * 2.0 ** -24 * (x.double().abs() @ wd.abs().T + b.double().abs())
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()


def test_kernel_is_bit_for_bit_the_fp32_panel_gemm_on_the_dequantized_weights(each_build):
    # The same FMAs in the same order as kernels/cpu_gemm.c: why a quantized model's tokens equal
    # its dequantized fp32 model's on the CPU path (register kernels and dequantized panels alike)
    if not cpu_ext.gemm_available():
        pytest.skip(f"the {each_build} build has no fp32 panel GEMM (kernels/cpu_gemm.c) to compare with")
    # K 1024: rows 4 KiB apart, read from a copy past 8 rows (kernels/cpu_panel.h lmi_panel_pad)
    for n, k, g, bits in [(96, 256, 32, 4), (50, 130, 64, 4), (64, 64, 32, 8), (40, 1024, 64, 4)]:
        w = _grouped(n, k, g, bits, seed=n)
        pw = cpu_ext.pack_panels(w.dequantize())
        for m in (1, 3, 4, 37):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
            b = torch.randn(n, generator=torch.Generator().manual_seed(3))
            for bias in (None, b):
                got = cpu_ext.gemm_q(x, pack(w), n, bias)
                ref = cpu_ext.gemm(x, pw, n, bias)
                assert torch.equal(got, ref), (n, k, g, bits, m, bias is None)


@both_x86
@pytest.mark.parametrize("bits", [4, 8])
def test_avx2_grouped_kernel_is_the_avx512_builds_values(bits):
    # The avx2 build's outputs equal the avx512 build's on the same inputs: m across both builds' row
    # blocks and the dequantized-panel path, k not a multiple of 4 or of the group, n not a multiple
    # of 32, several group sizes, with and without bias.
    gen = torch.Generator().manual_seed(5)
    try:
        for m, n, k, g in [(1, 576, 576, 64), (2, 33, 70, 32), (3, 192, 129, 128), (4, 100, 96, 16), (5, 40, 100, 32),
                           (12, 70, 77, 7), (13, 1536, 576, 32), (50, 97, 203, 64), (128, 65, 130, 128),
                           (300, 45, 61, 16)]:
            w = _grouped(n, k, g, bits, seed=m)
            p = pack(w)
            x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
            got = {}
            for build in ("avx512", "avx2"):
                cpu_ext.select(build)
                assert cpu_ext.gemm_q_available(), build
                got[build] = [cpu_ext.gemm_q(x, p, n, bias) for bias in (None, b)]
            for a, c in zip(got["avx512"], got["avx2"]):
                assert torch.equal(a, c), (m, n, k, g)
    finally:
        cpu_ext.select(None)


def test_dequantize_rounds_once_as_the_format_defines():
    w = _grouped(8, 64, 32, 4)
    z = -w.mins / w.scales
    want = ((w.q.double() - z.repeat_interleave(32, 1).double()) * w.scales.repeat_interleave(32, 1).double())
    assert torch.equal(w.dequantize().double(), want)       # (q - z) * s is exact in fp32


def test_packed_layout_round_trips():
    for bits in (4, 8):
        w = _grouped(45, 70, 32, bits)
        m = grouped_linear(nn.Linear(70, 45), w, "test", kernel=True)
        back = grouped_of(m)
        assert torch.equal(back.q, w.q) and torch.equal(back.scales, w.scales) and torch.equal(back.mins, w.mins)


def test_tensor_parallel_cuts_whole_groups():
    w = _grouped(64, 128, 32, 4)
    full = w.dequantize()
    cols = [w.cut("column", r, 2).dequantize() for r in range(2)]
    rows = [w.cut("row", r, 2).dequantize() for r in range(2)]
    assert torch.equal(torch.cat(cols, 0), full) and torch.equal(torch.cat(rows, 1), full)
    with pytest.raises(QuantLoadError, match="whole groups"):
        w.cut("row", 0, 3)


# ---------------------------------------------------------------------------- the formats
def _awq_doc_unpack(qweight, qzeros, scales, g):
    """From AutoAWQ's GEMM description: int32 [K, N/8], nibble i of word c = column 8c + ORDER[i]."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    q = np.zeros((k, n), np.int64)
    z = np.zeros((qzeros.shape[0], n), np.int64)
    for src, dst in ((qweight, q), (qzeros, z)):
        words = src.numpy().astype(np.int64) & 0xFFFFFFFF
        for c in range(src.shape[1]):
            for i in range(8):
                dst[:, 8 * c + AWQ_ORDER_DOC[i]] = (words[:, c] >> (4 * i)) & 0xF
    s = scales.float().numpy().astype(np.float64)
    return (q - np.repeat(z, g, 0)) * np.repeat(s, g, 0)          # [K, N]


def _gptq_doc_unpack(qweight, qzeros, scales, g_idx):
    """From GPTQ's description: qweight int32 [K/8, N] (k = 8r + i at nibble i), qzeros [G, N/8]
    (n = 8c + i), v1 stores zero - 1."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    words = qweight.numpy().astype(np.int64) & 0xFFFFFFFF
    zw = qzeros.numpy().astype(np.int64) & 0xFFFFFFFF
    w = np.zeros((k, n))
    s = scales.float().numpy().astype(np.float64)
    for kk in range(k):
        grp = int(g_idx[kk])
        for nn_ in range(n):
            q = (words[kk // 8, nn_] >> (4 * (kk % 8))) & 0xF
            z = ((zw[grp, nn_ // 8] >> (4 * (nn_ % 8))) & 0xF) + 1
            w[kk, nn_] = (q - z) * s[grp, nn_]
    return w


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_pack_and_unpack_against_the_documented_layout(sym):
    from handler.tools.quantize_checkpoint import rtn
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    q, z, s = rtn(w, 16, sym=sym, min_zero=1)
    t = qf.gptq_pack(q, z, s, 16)
    doc = _gptq_doc_unpack(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
    ours = qf.gptq_unpack(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 16, zeros_plus_one=True)
    assert np.array_equal(ours.dequantize().double().numpy(), doc.T)
    assert (torch.from_numpy(doc.T).float() - w).abs().max() <= s.max() * 1.01   # RTN: within a step
    bad = t["g_idx"].flip(0)
    with pytest.raises(QuantLoadError, match="desc_act"):
        qf.gptq_unpack(t["qweight"], t["qzeros"], t["scales"], bad, 16, True, "layer")


def test_awq_pack_and_unpack_against_the_documented_layout():
    from handler.tools.quantize_checkpoint import rtn
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    q, z, s = rtn(w, 32, sym=False)
    t = qf.awq_pack(q, z, s)
    assert t["qweight"].shape == (64, 4) and t["qzeros"].shape == (2, 4) and t["scales"].shape == (2, 32)
    doc = _awq_doc_unpack(t["qweight"], t["qzeros"], t["scales"], 32)
    ours = qf.awq_unpack(t["qweight"], t["qzeros"], t["scales"], 32)
    assert np.array_equal(ours.dequantize().double().numpy(), doc.T)
    assert (torch.from_numpy(doc.T).float() - w).abs().max() <= s.max() * 0.51   # asymmetric RTN: half a step


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_against_the_gguf_packages_dequantizer(kind):
    import gguf
    from gguf import quants
    qt = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(5).standard_normal((12, 96)).astype(np.float32)
    raw = quants.quantize(w, qt)
    ours = qf.gguf_blocks(kind, raw, 12, 96).dequantize().numpy()
    assert np.array_equal(ours, quants.dequantize(raw, qt))


# ---------------------------------------------------------------------------- a tiny model's checkpoints, served
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo_model_dir):
    """A tiny Llama whose every linear input width is a multiple of 32 (GGUF's block), random weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    d = str(tmp_path_factory.mktemp("tiny32"))
    base = json.load(open(os.path.join(demo_model_dir, "config.json")))
    cfg = LlamaConfig(vocab_size=base["vocab_size"], hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    for f in os.listdir(demo_model_dir):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(demo_model_dir, f), d)
    return d


def _float_dir(src: str, dst: str, weights: dict[str, torch.Tensor]) -> str:
    """A float copy of `src` with `weights` (name -> [N, K]) replacing or adding layers' weights."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    tensors = {k: v for k, v in load_file(os.path.join(src, "model.safetensors")).items()
               if k.rpartition(".")[2] not in qf.PARTS}
    tensors.update({k: v.contiguous() for k, v in weights.items()})
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.pop("quantization_config", None)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def _doc_dequantized(qdir: str, method: str, g: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    t = load_file(os.path.join(qdir, "model.safetensors"))
    out = {}
    for key in t:
        if key.endswith(".qweight"):
            p = key.removesuffix(".qweight")
            if method == "awq":
                w = _awq_doc_unpack(t[key], t[p + ".qzeros"], t[p + ".scales"], g)
            else:
                w = _gptq_doc_unpack(t[key], t[p + ".qzeros"], t[p + ".scales"], t[p + ".g_idx"])
            out[p + ".weight"] = torch.from_numpy(w.T).float()
    return out


def _tokens(model_dir, tmp_path, props):
    engine = make_engine(model_dir, tmp_path, props)
    try:
        layer = engine.runner.model.model.layers[0].mlp.down_proj
        results = run_all(engine, PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW])
        return is_grouped(layer), [ids for ids, _ in results]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_tiny_checkpoint_serves_the_tokens_of_its_dequantized_fp32_model(method, tiny_dir, tmp_path):
    from handler.tools.quantize_checkpoint import quantize_checkpoint
    qdir = str(tmp_path / method)
    quantize_checkpoint(tiny_dir, qdir, method, group=32)
    ref = _float_dir(qdir, str(tmp_path / f"{method}-fp32"), _doc_dequantized(qdir, method, 32))
    assert load_config(None, qdir, env={}).quantize == method     # detected without option.quantize
    for strategy in ("paged", "dynamic"):
        props = {**STRATEGIES[strategy], "option.dtype": "fp32"}
        kind, got = _tokens(qdir, tmp_path, props)
        _, want = _tokens(ref, tmp_path, props)
        assert kind
        assert got == want, strategy


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (pairs of rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_tiny_gguf_serves_the_tokens_of_its_dequantized_fp32_model(tiny_dir, tmp_path):
    import gguf
    from gguf import quants
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(tiny_dir, "config.json")))
    sd = load_file(os.path.join(tiny_dir, "model.safetensors"))
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    kinds = ["Q4_0", "Q4_1", "Q8_0"]
    names = {v: k for k, v in qf.GGUF_LINEARS.items()}
    deq = {}
    for i in range(cfg["num_hidden_layers"]):
        for j, (leaf, heads) in enumerate([("self_attn.q_proj", cfg["num_attention_heads"]),
                                           ("self_attn.k_proj", cfg["num_key_value_heads"]),
                                           ("self_attn.v_proj", 0), ("self_attn.o_proj", 0),
                                           ("mlp.gate_proj", 0), ("mlp.up_proj", 0), ("mlp.down_proj", 0)]):
            key = f"model.layers.{i}.{leaf}.weight"
            w = sd[key].numpy()
            rows = np.arange(w.shape[0])
            if heads:
                rows = _llamacpp_permute(rows, heads)
            kind = kinds[(i + j) % 3]
            qt = getattr(gguf.GGMLQuantizationType, kind)
            raw = quants.quantize(w[rows], qt)
            writer.add_tensor(f"blk.{i}.{names[leaf]}.weight", raw, raw_shape=raw.shape, raw_dtype=qt)
            back = np.empty_like(w)
            back[rows] = quants.dequantize(raw, qt)
            deq[key] = torch.from_numpy(back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = _float_dir(tiny_dir, str(tmp_path / "gguf-fp32"), deq)
    with open(os.path.join(ref, "converted_from.json"), "w") as f:
        json.dump({"gguf": str(tmp_path / "tiny.gguf")}, f)
    for strategy in ("paged", "rolling"):
        props = {**STRATEGIES[strategy], "option.dtype": "fp32"}
        kind, got = _tokens(ref, tmp_path, {**props, "option.quantize": "gguf"})
        plain, want = _tokens(ref, tmp_path, props)
        assert kind and not plain
        assert got == want, strategy


def test_lora_wraps_a_grouped_layer(tiny_dir, tmp_path):
    from handler.model.lora import LoRALinear
    w = _grouped(64, 256, 32, 4)
    m = grouped_linear(nn.Linear(256, 64, bias=False), w, "test", kernel=cpu_ext.gemm_q_available())
    wrapped = LoRALinear(m, slots=1, max_rank=4)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 256, generator=g), torch.randn(64, 2, generator=g)
    wrapped.load(0, (a, b))
    assert wrapped.lora_a.dtype == torch.float32        # the activation dtype, from the empty weight
    x = torch.randn(3, 256, generator=g)
    assert torch.allclose(m(x), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.bfloat16), ("cpu", torch.float32),
    pytest.param("cuda", torch.float16, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the torch path on CUDA needs a CUDA device")])])
def test_grouped_layer_in_the_activation_dtype(device, dtype):
    # bf16 on the CPU kernel: fp32 inside, one rounding of the output; elsewhere (CUDA, no kernel) the
    # weight dequantized to the activation dtype and multiplied by torch
    from handler.model.quant_int4 import use_kernel
    w = _grouped(64, 96, 32, 4)
    m = nn.Linear(96, 64, dtype=dtype, device=device)
    bias = m.bias.detach().float().cpu()
    m = grouped_linear(m, w, "test", kernel=use_kernel(torch.device(device)))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = m(x.to(device))
    assert y.dtype == dtype and y.device.type == device
    want = x.double() @ w.dequantize().double().T + bias.double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert ((y.cpu().double() - want).abs().max() / want.abs().max()).item() < tol


# ---------------------------------------------------------------------------- configuration
def _with_qc(src: str, dst, **qc) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"] = qc
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def _props(tmp_path, **kv) -> str:
    p = tmp_path / "serving.properties"
    p.write_text("".join(f"{k}={v}\n" for k, v in kv.items()))
    return str(p)


@pytest.mark.parametrize("qc,props,match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 32}, {"option.quantize": "gptq"},
     "option.quantize=gptq but the checkpoint is AWQ-quantized"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32}, {"option.quantize": "int8"},
     "option.quantize=int8 but the checkpoint is AWQ"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, {}, r"quantization_config.bits=8 .*allowed: 4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, {}, "desc_act=true"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, {}, "version='gemv'"),
    ({"quant_method": "bitsandbytes"}, {}, "quant_method='bitsandbytes' is not supported"),
])
def test_bad_quantization_configs_are_one_line(demo_model_dir, tmp_path, qc, props, match):
    d = _with_qc(demo_model_dir, tmp_path / "m", **qc)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(_props(tmp_path, **props), d, env={})
    assert "\n" not in str(e.value)


def test_quantize_values_checked_without_a_quantized_checkpoint(demo_model_dir, tmp_path):
    for value, match in (("awq", "needs a checkpoint quantized by AWQ"), ("gguf", "needs a .gguf model"),
                         ("fp8", "fp8 needs a GPU")):
        with pytest.raises(ConfigError, match=match):
            load_config(_props(tmp_path, **{"option.quantize": value}), demo_model_dir, env={}, gpu_count=0)
    with pytest.raises(ConfigError, match="allowed: int8, int8_weight_only, awq, gptq, gguf, fp8, none"):
        load_config(_props(tmp_path, **{"option.quantize": "nf4"}), demo_model_dir, env={})
    assert load_config(None, demo_model_dir, env={}).quantize is None


def test_transformers_implementation_refuses_a_quantized_checkpoint(tiny_dir, tmp_path):
    from handler.model.runner import ModelLoadError, ModelRunner
    from handler.tools.quantize_checkpoint import quantize_checkpoint
    qdir = str(tmp_path / "awq")
    quantize_checkpoint(tiny_dir, qdir, "awq", group=32)
    with pytest.raises(ModelLoadError, match="AWQ checkpoints are served by our Llama-family implementation only"):
        ModelRunner(qdir, dtype="fp32", device="cpu", kv_cache_tokens=64, model_impl="transformers")


def test_quantize_checkpoint_refuses_a_group_that_does_not_divide(demo_model_dir, tmp_path):
    from handler.tools.quantize_checkpoint import main
    assert main(["--method", "awq", "--group-size", "128", demo_model_dir, str(tmp_path / "x")]) == 2


# ---------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def real_quantized(real_model_dir):
    """AWQ and GPTQ copies (RTN, group 64) of the real model, made once beside it in .cache/models."""
    from handler.tools.quantize_checkpoint import quantize_checkpoint
    out = {}
    for method in ("awq", "gptq"):
        d = f"{real_model_dir}-{method}"
        if not os.path.isfile(os.path.join(d, "model.safetensors")):
            quantize_checkpoint(real_model_dir, d, method, group=64)
        out[method] = d
    return out


def _chat_answers(model_dir, quantize, n=4, new=24):
    from handler.tools import quality
    engine = quality.engine_for(model_dir, "fp32", quantize)
    try:
        return quality.chat_answers(engine, quality.chat_ids(engine.runner.tokenizer, quality.CHAT[:n]), new)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_real_model_checkpoint_has_the_greedy_answers_of_its_dequantized_model(real_quantized, method):
    d = real_quantized[method]
    assert _chat_answers(d, None) == _chat_answers(d, "none")


def test_real_gguf_q4_1_served_quantized_is_its_dequantized_model(real_model_dir):
    # The weights: bit for bit what transformers' GGUF loader (gguf's dequantizer + its q/k
    # un-permutation) wrote into the fp32 directory; then the answers.
    from safetensors import safe_open
    from handler.model.runner import ModelRunner
    r = ModelRunner(real_model_dir, dtype="fp32", device="cpu", kv_cache_tokens=64, quantize="gguf")
    layers = {n: m for n, m in r.model.named_modules() if is_grouped(m)}
    assert len(layers) == 7 * r.model.arch.layers
    with safe_open(os.path.join(real_model_dir, "model.safetensors"), framework="pt") as f:
        for name, m in layers.items():
            assert torch.equal(grouped_of(m).dequantize(), f.get_tensor(name + ".weight")), name
    # (the real_gguf fixture reads provenance.json's absolute path, stale in a shared cache: found as served)
    from handler.config.quantization import gguf_source
    real_gguf = gguf_source(real_model_dir)
    assert load_config(None, real_gguf, env={}).quantize == "gguf"      # a .gguf model_id: quantized by default
    assert _chat_answers(real_model_dir, "gguf") == _chat_answers(real_model_dir, None)


def test_awq_at_tensor_parallel_degree_2_gives_the_one_rank_tokens(tiny_dir, tmp_path):
    # Column-parallel layers cut along N, row-parallel ones along K in whole groups (11 of 22 per
    # rank for down_proj); two CPU ranks (gloo) against one.
    from handler.tools.quantize_checkpoint import quantize_checkpoint
    from tests.model.test_tp import _run_parity
    from tests.support.tp_parity import NEW_TP
    qdir = str(tmp_path / "awq")
    quantize_checkpoint(tiny_dir, qdir, "awq", group=32)
    props = tmp_path / "props"
    props.mkdir()
    out = _run_parity(qdir, props)
    engine = make_engine(qdir, tmp_path, {**STRATEGIES["paged"], "option.dtype": "fp32"})
    try:
        want = [ids for ids, _ in run_all(engine, PROMPTS, [SamplingParams(max_new_tokens=n) for n in NEW_TP])]
    finally:
        engine.shutdown()
    for strategy in STRATEGIES:
        assert out[strategy] == want, strategy
