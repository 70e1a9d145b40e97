"""GGUF tensors served as their own blocks (handler/model/quant_formats.py gguf_blocks / install_gguf):
every block type against the gguf package's own dequantizer bit for bit (synthetic blocks and, where
the file is here, Qwen's q4_k_m tensors), the kernel on K-quant groups bit for bit the fp32 panel GEMM,
and a tiny qwen2 GGUF (no q/k permutation, its own output head, K-quants) served with the greedy tokens
of its dequantized fp32 model."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from handler.engine.request import SamplingParams
from handler.model import quant_formats as qf
from handler.model.quant_int4 import is_grouped, pack
from kernels import cpu as cpu_ext
from tests.support.engine import NEW, PROMPTS, STRATEGIES, make_engine, run_all
from tests.support.kernels import each_build_fixture

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
from gguf import quants  # noqa: E402

each_build = each_build_fixture("gemm_q_available", "grouped-weight GEMM")
QWEN_GGUF = Path(__file__).resolve().parents[2] / ".cache" / "models" / "downloads" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

# The fp16 fields of each K-quant block (byte offsets) and a magnitude for them that keeps a tiny
# model's activations finite; the rest of a block (codes, 6-bit / int8 sub-scales) is any byte.
K_FIELDS = {"Q4_K": ([0, 2], 1e-4), "Q5_K": ([0, 2], 5e-5), "Q6_K": ([208], 1e-5)}


def _raw(kind: str, w: np.ndarray, rng) -> np.ndarray:
    """GGUF blocks of type `kind` for a [N, K] weight: the gguf package's quantizer where it has one,
    else random blocks with small fp16 scales (the package cannot make K-quants)."""
    qt = getattr(gguf.GGMLQuantizationType, kind)
    if kind not in K_FIELDS:
        return quants.quantize(w, qt)
    n, k = w.shape
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (n, k // bs, ts), dtype=np.uint8)
    offsets, size = K_FIELDS[kind]
    for off in offsets:
        raw[..., off:off + 2] = (rng.random((n, k // bs, 1)) * size).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", qf.GGUF_SERVED)
def test_blocks_dequantize_as_the_gguf_package_does(kind):
    rng = np.random.default_rng(5)
    n, k = 12, 512
    raw = _raw(kind, rng.standard_normal((n, k)).astype(np.float32), rng)
    w = qf.gguf_blocks(kind, raw, n, k)
    assert w.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert w.group == (16 if kind == "Q6_K" else 32)
    assert int(w.q.max()) < 2 ** {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6,
                                  "Q8_0": 8}[kind]
    want = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    assert np.array_equal(w.dequantize().numpy(), want)


def test_qwen_files_tensors_dequantize_as_the_gguf_package_does():
    if not QWEN_GGUF.is_file():
        pytest.skip(f"{QWEN_GGUF} is absent; fetch it with: python -m handler build-demo-model --family "
                    "qwen2.5-coder-0.5b .cache/models/qwen2.5-coder-0.5b")
    seen = set()
    for t in gguf.GGUFReader(str(QWEN_GGUF)).tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in qf.GGUF_SERVED or len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)
        rows = min(n, 64)           # a slice of rows: every block type's layout, not the whole file
        raw = np.asarray(t.data)[:rows]
        got = qf.gguf_blocks(kind, raw, rows, k).dequantize().numpy()
        assert np.array_equal(got, quants.dequantize(raw, t.tensor_type)), t.name
        seen.add(kind)
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= seen, seen


def test_kernel_on_k_quant_groups_is_the_fp32_panel_gemm_bit_for_bit(each_build):
    if not cpu_ext.gemm_available():
        pytest.skip(f"the {each_build} build has no fp32 panel GEMM (kernels/cpu_gemm.c) to compare with")
    rng = np.random.default_rng(7)
    for kind, n in (("Q4_K", 70), ("Q6_K", 40), ("Q5_0", 33), ("Q5_K", 64)):
        k = 512
        w = qf.gguf_blocks(kind, _raw(kind, rng.standard_normal((n, k)).astype(np.float32), rng), n, k)
        pw = cpu_ext.pack_panels(w.dequantize())
        for m in (1, 3, 37):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            got = cpu_ext.gemm_q(x, pack(w), n, None)
            assert torch.equal(got, cpu_ext.gemm(x, pw, n, None)), (kind, m)


# ---------------------------------------------------------------------------- a tiny qwen2 GGUF, served
KINDS = ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q5_1", "Q5_K", "Q4_0"]
LEAVES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.fixture(scope="module")
def tiny_qwen2_gguf(tmp_path_factory, demo_model_dir):
    """A tiny qwen2 (q/k/v biases, GQA 8/2, untied head; widths multiples of 256 for the K-quants)
    written as a GGUF file of mixed block types in the checkpoint's row order, as llama.cpp writes
    qwen2, and its fp32 directory holding the gguf package's dequantized weights (converted_from.json
    naming the file, as handler/model/gguf.py leaves it)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen2Config
    root = tmp_path_factory.mktemp("qwen2gguf")
    d = str(root / "fp32")
    base = json.load(open(os.path.join(demo_model_dir, "config.json")))
    cfg = Qwen2Config(vocab_size=base["vocab_size"], hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=base.get("bos_token_id"),
                      eos_token_id=base.get("eos_token_id"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    for f in os.listdir(demo_model_dir):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(demo_model_dir, f), d)
    sd = load_file(os.path.join(d, "model.safetensors"))
    path = str(root / "tiny-qwen2.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    names = {v: k for k, v in qf.GGUF_LINEARS.items()}
    rng = np.random.default_rng(0)
    for i in range(cfg.num_hidden_layers):
        for j, leaf in enumerate(LEAVES):
            key = f"model.layers.{i}.{leaf}.weight"
            kind = KINDS[(i * len(LEAVES) + j) % len(KINDS)]
            raw = _raw(kind, sd[key].numpy(), rng)
            qt = getattr(gguf.GGMLQuantizationType, kind)
            writer.add_tensor(f"blk.{i}.{names[leaf]}.weight", raw, raw_shape=raw.shape, raw_dtype=qt)
            sd[key] = torch.from_numpy(quants.dequantize(raw, qt)).contiguous()
    raw = _raw("Q6_K", sd["lm_head.weight"].numpy(), rng)
    writer.add_tensor("output.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    sd["lm_head.weight"] = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)).contiguous()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "converted_from.json"), "w") as f:
        json.dump({"gguf": path}, f)
    return d


def _tokens(model_dir, tmp_path, props):
    engine = make_engine(model_dir, tmp_path, props)
    try:
        model = engine.runner.model
        served = {n: m.pack.fmt for n, m in model.named_modules() if is_grouped(m)}
        widths = {m.pack.bits for m in model.modules() if is_grouped(m)}
        if widths and props.get("option.grouped_code_layout") == "packed":
            assert {5, 6} <= widths, widths          # Q5_*'s and Q6_K's codes streamed packed
        elif widths:
            assert widths == {4, 8}, widths
        results = run_all(engine, PROMPTS[:4], [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW[:4]])
        return served, [ids for ids, _ in results]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy,layout", [("paged", "bytes"), ("rolling", "bytes"), ("paged", "packed")])
def test_tiny_qwen2_gguf_serves_the_tokens_of_its_dequantized_fp32_model(tiny_qwen2_gguf, tmp_path, strategy,
                                                                         layout):
    # packed: the 5/6-bit codes as bit planes (option.grouped_code_layout), through the C layer stack too
    props = {**STRATEGIES[strategy], "option.dtype": "fp32"}
    served, got = _tokens(tiny_qwen2_gguf, tmp_path,
                          {**props, "option.quantize": "gguf", "option.grouped_code_layout": layout})
    plain, want = _tokens(tiny_qwen2_gguf, tmp_path, props)
    assert not plain
    assert len(served) == 3 * len(LEAVES) + 1 and served["lm_head"] == "gguf Q6_K"
    assert {f.removeprefix("gguf ") for f in served.values()} == set(KINDS)
    assert got == want, strategy


def test_tiny_qwen2_gguf_with_int8_activations_serves_batch_invariant_tokens(tiny_qwen2_gguf, tmp_path, caplog):
    """option.cpu_grouped_activations=int8 (kernels/cpu_gemm_q4.c's int8-activation path): the load log says so, and each
    request's tokens are the same whether it runs beside the others or alone (rows are quantized one by
    one), through the C layer stack."""
    import logging
    if not cpu_ext.gemm_q_available() or not cpu_ext.q_act8_available():
        pytest.skip("the int8-activation path needs the avx512 build with VNNI and VBMI or the avx2 build; this "
                    "CPU's build has none")
    props = {**STRATEGIES["paged"], "option.dtype": "fp32", "option.quantize": "gguf",
             "option.cpu_grouped_activations": "int8"}
    with caplog.at_level(logging.INFO, logger="lmi"):
        engine = make_engine(tiny_qwen2_gguf, tmp_path, props)
    try:
        assert any("int8 activations" in r.getMessage() for r in caplog.records)
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW[:4]]
        together = [ids for ids, _ in run_all(engine, PROMPTS[:4], params)]
        alone = [run_all(engine, [p], [sp])[0][0] for p, sp in zip(PROMPTS[:4], params)]
    finally:
        engine.shutdown()
    assert together == alone
    assert [len(t) for t in together] == list(NEW[:4])
