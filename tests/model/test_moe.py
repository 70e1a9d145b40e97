"""Mixture-of-experts models on our own implementation (handler/model/moe.py): Qwen3-MoE (dense
layers between sparse ones), Qwen2-MoE (shared expert and its sigmoid gate), Mixtral (Mixtral's
checkpoint names, renormalised top-k), OLMoE (no renormalisation, q/k norms over the projections),
tiny random configs built here with transformers' config classes, in both checkpoint layouts
(per expert, as transformers saves them, and the fused 3-D tensors); against transformers' model
of the same checkpoint: logits, greedy tokens under every strategy, int8 KV, tensor parallel 2."""
from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from handler.engine.request import SamplingParams
from handler.model.moe import SparseMoe
from handler.model.runner import ModelLoadError, ModelRunner
from tests.model.test_cpu_stack import _WHY, BUILD
from tests.model.test_llama import _step_logits
from tests.support.engine import NEW, PROMPTS, STRATEGIES, assert_drained, make_engine, run_all
from tests.support.reference import hf_greedy

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, initializer_range=0.2)
CONFIGS = {
    # layer 1 dense (mlp_only_layers), norm_topk_prob on
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         intermediate_size=96, head_dim=16, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
    # decoder_sparse_step 2: layer 1 sparse, 0 and 2 dense; a shared expert; norm_topk_prob off
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, intermediate_size=96,
                                         decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False)),
}
FAMILIES = list(CONFIGS)


def _tokenizer_files(src: str, dst: str) -> None:
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(src, f), dst)


def build(family: str, path: str, demo_dir: str, fused: bool = False, **over) -> str:
    """A tiny random `family` checkpoint in `path`: transformers' own save (per-expert tensors), or
    with `fused` its state dict as is (transformers 5's 3-D `mlp.experts.gate_up_proj` / `down_proj`)."""
    import transformers
    from safetensors.torch import save_file

    cls, kw = CONFIGS[family]
    demo = json.load(open(os.path.join(demo_dir, "config.json")))
    ids = {k: demo.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = getattr(transformers, cls)(vocab_size=demo["vocab_size"], **{**BASE, **kw, **over}, **ids)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if family == "qwen2_moe":   # random q/k/v biases (zeros would not show a bias read wrongly)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    if fused:
        os.remove(os.path.join(path, "model.safetensors"))
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
              or not config.tie_word_embeddings}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _tokenizer_files(demo_dir, path)
    return path


@pytest.fixture(scope="module")
def moe_dirs(demo_model_dir, tmp_path_factory):
    out = {f: build(f, str(tmp_path_factory.mktemp(f)), demo_model_dir) for f in FAMILIES}
    for f in ("qwen3_moe", "mixtral"):
        out[f + "-fused"] = build(f, str(tmp_path_factory.mktemp(f + "-fused")), demo_model_dir, fused=True)
    return out


def test_checkpoint_layouts_are_what_transformers_saves(moe_dirs):
    from safetensors import safe_open
    with safe_open(os.path.join(moe_dirs["mixtral"], "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in f.keys()
    with safe_open(os.path.join(moe_dirs["qwen2_moe"], "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight",
            "model.layers.0.mlp.down_proj.weight"} <= keys
    with safe_open(os.path.join(moe_dirs["qwen3_moe-fused"], "model.safetensors"), "pt") as f:
        assert list(f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()) == [8, 64, 64]


@pytest.mark.parametrize("name", FAMILIES + ["qwen3_moe-fused", "mixtral-fused"])
def test_our_moe_logits_match_transformers(name, moe_dirs, caplog):
    family = name.removesuffix("-fused")
    with caplog.at_level(logging.INFO, logger="lmi"):
        ours = ModelRunner(moe_dirs[name], dtype="fp32", device="cpu", kv_cache_tokens=128)
        ours.prepack_cpu()      # as the server does: every expert's linears packed for the CPU GEMM
    assert ours.own and ours.model.arch.moe is not None
    sparse = ours.model.model.layers[ours.model.arch.moe.sparse.index(True)].mlp
    assert type(sparse.experts[0].down_proj).__name__ == "CpuLinear"
    assert any(r.getMessage().startswith(f"model: our MoE implementation of {family}") for r in caplog.records)
    # every family's layers in the C layer stack, said once
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU: a step's layers")]
    assert len(said) == 1 and ("in one C call" in said[0] or bool(_WHY)), said
    theirs = ModelRunner(moe_dirs[name], dtype="fp32", device="cpu", kv_cache_tokens=128, model_impl="transformers")
    for got, want in zip(_step_logits(ours), _step_logits(theirs)):
        # transformers' experts run grouped_mm and SiLU on a strided half: ulps apart, same argmax
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (name, (got - want).abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_is_as_close_to_fp32_as_transformers_bf16(family, moe_dirs):
    """bf16 rounds differently per implementation (and may route a row to another expert): ours must stay
    as near to the fp32 logits as transformers' own bf16 model does."""
    def rel(got, want):
        return ((got.float() - want).norm() / want.norm()).item()

    d = moe_dirs[family]
    want = _step_logits(ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=128))
    ours = ModelRunner(d, dtype="bf16", device="cpu", kv_cache_tokens=128)
    ours.prepack_cpu()
    theirs = ModelRunner(d, dtype="bf16", device="cpu", kv_cache_tokens=128, model_impl="transformers")
    assert ours.own and ours.model.lm_head.weight.dtype == torch.bfloat16
    for got, ref, w in zip(_step_logits(ours), _step_logits(theirs), want):
        assert rel(got, w) <= max(1.5 * rel(ref, w), 0.02), (family, rel(got, w), rel(ref, w))


def test_both_layouts_load_the_same_model_bit_for_bit(moe_dirs):
    def logits(d):
        r = ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=128)
        r.prepack_cpu()
        return _step_logits(r)
    for family in ("qwen3_moe", "mixtral"):
        a, b = logits(moe_dirs[family]), logits(moe_dirs[family + "-fused"])
        assert all(torch.equal(x, y) for x, y in zip(a, b)), family


@pytest.mark.skipif(bool(_WHY), reason=_WHY)
@pytest.mark.parametrize("name,dtype,quantize", [("qwen3_moe", "fp32", None), ("qwen3_moe", "bf16", None),
                                                 ("mixtral", "fp32", None), ("mixtral", "bf16", None),
                                                 ("olmoe", "fp32", None), ("olmoe", "bf16", None),
                                                 ("qwen2_moe", "fp32", None), ("qwen2_moe", "bf16", None),
                                                 ("qwen3_moe-fused", "fp32", "int8_weight_only")])
def test_the_c_layer_stack_gives_the_python_layers_values_bit_for_bit(name, dtype, quantize, moe_dirs):
    """Sparse layers in the C layer stack (kernels/cpu_layer.c: the router's GEMM, lmi_moe_route,
    lmi_moe_experts): prompt, mixed and decode steps give the logits and KV pools of the Python
    layers (which route by the same calls) bit for bit; Qwen3-MoE's dense layer and per-head q/k norms,
    OLMoE's norms over the whole projection, Qwen2-MoE's biases and gated shared expert too."""
    from tests.model.test_cpu_stack import _runner, _steps
    fast, slow = _runner(moe_dirs[name], dtype, quantize), _runner(moe_dirs[name], dtype, quantize, stack=False)
    stack = fast.model.decode_stack
    assert stack is not None and slow.model.decode_stack is None
    calls = []
    got, got_kv = _steps(fast, calls)
    want, want_kv = _steps(slow, [])
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w), (name, dtype, (g.float() - w.float()).abs().max().item())
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert calls == ([True, True] if stack.prompts else [False, False]) + [True] * 6
    assert stack.prompts or dtype == "bf16"


def test_the_bound_router_routes_as_the_reference(moe_dirs):
    """Bound to the C kernels (prepacked), the router's logits come from our fp32 GEMM and its choice
    from lmi_moe_route: the same experts as transformers' router module and weights within fp32's
    rounding, ties to the lower id, bf16 weights rounded as the reference rounds them."""
    from transformers import AutoModelForCausalLM
    if _WHY:
        pytest.skip(_WHY)
    for family in FAMILIES:
        r = ModelRunner(moe_dirs[family], dtype="fp32", device="cpu", kv_cache_tokens=64, cpu_kernels=BUILD)
        r.prepack_cpu()
        ref = AutoModelForCausalLM.from_pretrained(moe_dirs[family], dtype=torch.float32)
        i = r.model.arch.moe.sparse.index(True)
        mine = r.model.model.layers[i].mlp
        assert mine.cpu_router is not None, family
        x = torch.randn(33, 64, generator=torch.Generator().manual_seed(2))
        w, ids = mine.route(x)
        _, rw, rids = ref.model.layers[i].mlp.gate(x)
        assert torch.equal(ids, rids), family
        assert w.dtype == rw.dtype and torch.allclose(w, rw, rtol=1e-5, atol=1e-7), family
    # ties: equal logits pick the lower ids, in order; renormalised weights sum to 1
    from kernels import cpu as cpu_ext
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    w, ids = cpu_ext.moe_route(logits, 2, True, False)
    assert ids.tolist() == [[1, 2], [0, 1]] and torch.equal(w, torch.full((2, 2), 0.5))
    w, ids = cpu_ext.moe_route(logits, 3, False, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.allclose(w, torch.softmax(logits, -1).gather(1, ids))
    wb, _ = cpu_ext.moe_route(torch.randn(4, 8), 3, True, True)      # bf16 values, as .to(bfloat16)
    assert torch.equal(wb, wb.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="top-6 of 5 experts"):
        cpu_ext.moe_route(logits, 6, True, False)


def test_routing_follows_each_reference(moe_dirs):
    """The router's weights and choices against the reference router module of each family on the same
    rows: top-k of the fp32 softmax, renormalised where the family does, ties to the lower index."""
    from transformers import AutoModelForCausalLM
    for family in FAMILIES:
        ours = ModelRunner(moe_dirs[family], dtype="fp32", device="cpu", kv_cache_tokens=64).model
        ref = AutoModelForCausalLM.from_pretrained(moe_dirs[family], dtype=torch.float32)
        i = ours.arch.moe.sparse.index(True)
        x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
        w, ids = ours.model.layers[i].mlp.route(x)
        _, rw, rids = ref.model.layers[i].mlp.gate(x)
        assert torch.equal(ids, rids) and torch.equal(w, rw), family
        sums = w.sum(-1)
        if family in ("qwen3_moe", "mixtral"):
            assert torch.allclose(sums, torch.ones_like(sums))
        else:
            assert (sums < 1).all()     # no renormalisation
    # deterministic given the logits: equal rows route alike, run after run
    x = torch.randn(1, 64).repeat(5, 1)
    layer = ours.model.layers[0].mlp
    w1, i1 = layer.route(x)
    w2, i2 = layer.route(x)
    assert torch.equal(i1, i2) and (i1 == i1[0]).all() and torch.equal(w1, w2)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_with_generate(family, strategy, moe_dirs, tmp_path):
    model_dir = moe_dirs[family]
    engine = make_engine(model_dir, tmp_path, STRATEGIES[strategy])
    try:
        assert engine.runner.own and engine.runner.model.arch.moe is not None
        # where the C kernels run, every sparse layer's experts go through the one C call (moe.py bind_kernel)
        bound = {m.cpu_experts is not None for m in engine.runner.model.modules() if isinstance(m, SparseMoe)}
        assert bound == ({False} if _WHY else {True}), _WHY
        results = run_all(engine, PROMPTS[:4], [SamplingParams(max_new_tokens=n) for n in NEW[:4]])
        for p, n, (ids, _) in zip(PROMPTS, NEW, results):
            assert ids == hf_greedy(model_dir, p, n), (family, strategy, p[:20])
        assert_drained(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_over_an_int8_kv_cache_follows_generate(family, moe_dirs, tmp_path):
    """int8 KV rounds every key and value (one scale per token and head), and these random models'
    logits are nearly flat (the top few within hundredths): the tokens are generate's greedy ones
    until, at most, a step where the token taken is one the fp32 model scores within 15% of its
    largest logit of its best (a choice int8's rounding can flip: a row whose rounded hidden state
    sends it to another expert in some layer moves more than a dense model's; after it the texts
    differ and are not compared). A wrong scale, block or routing of the dequantized rows gives
    tokens the fp32 model scores far below its best (random tokens: ~the logits' whole range)."""
    from tests.support.reference import _load
    model_dir = moe_dirs[family]
    engine = make_engine(model_dir, tmp_path, {**STRATEGIES["paged"], "option.kv_cache_dtype": "int8"})
    try:
        assert engine.runner.kv_cache[0][0].dtype == torch.int8
        params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in PROMPTS]
        results = run_all(engine, PROMPTS, params)
        assert_drained(engine)
    finally:
        engine.shutdown()
    tok, model = _load(model_dir)
    exact = 0
    for p, (ids, _) in zip(PROMPTS, results):
        want = hf_greedy(model_dir, p, 12, ignore_eos=True)
        assert len(ids) == 12
        i = next((i for i, (x, y) in enumerate(zip(ids, want)) if x != y), None)
        if i is None:
            exact += 1
            continue
        with torch.no_grad():
            logits = model(torch.tensor([tok(p)["input_ids"] + want[:i]])).logits[0, -1]
        gap = (logits[want[i]] - logits[ids[i]]).item()
        assert gap <= 0.15 * logits.abs().max().item(), (family, p[:20], i, gap)
    assert exact >= 1, family


@pytest.mark.parametrize("quantize,pack", [("int8", "Int8Pack"), ("int8_weight_only", "GroupedPack")])
def test_quantization_packs_every_expert_and_keeps_the_routers(quantize, pack, moe_dirs):
    from handler.model.linear import CpuLinear
    from handler.model.moe import Router
    runner = ModelRunner(moe_dirs["qwen2_moe"], dtype="fp32", device="cpu", kv_cache_tokens=128, quantize=quantize)
    runner.prepack_cpu()
    mlp = runner.model.model.layers[1].mlp
    for e in (*mlp.experts, mlp.shared_expert):
        for m in (e.gate_up_proj or e.gate_proj, e.down_proj):
            assert isinstance(m, CpuLinear) and type(m.pack).__name__ == pack, m
    assert type(mlp.gate) is Router and type(mlp.shared_expert_gate) is Router
    # close to the fp32 model: prompt log-probs within int8's error
    ref = ModelRunner(moe_dirs["qwen2_moe"], dtype="fp32", device="cpu", kv_cache_tokens=128)
    for got, want in zip(_step_logits(runner), _step_logits(ref)):
        err = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item()
        assert 0 < err < 0.5, err


def test_expert_count_disagreeing_with_the_checkpoint_is_one_line(moe_dirs, tmp_path):
    for name, field, value, match in (
            ("qwen3_moe", "num_experts", 16, r"router has 8 experts; config.json's experts count \(num_experts / num_local_experts\) is 16"),
            ("qwen3_moe", "num_experts", 4, r"router has 8 experts.*is 4|expert \d in layer 0.*is 4"),
            ("mixtral-fused", "num_local_experts", 8, r"holds 4 experts.*num_local_experts\) is 8"),
            ("qwen3_moe", "mlp_only_layers", [], r"layer 1 of the checkpoint has a dense MLP .*config.json makes it sparse \(mlp_only_layers")):
        bad = tmp_path / f"{name}-{value}"
        shutil.copytree(moe_dirs[name], bad)
        cfg = json.loads((bad / "config.json").read_text())
        if field.endswith("experts"):   # transformers 5 writes qwen3_moe's num_experts as num_local_experts
            field = next(f for f in ("num_experts", "num_local_experts") if f in cfg)
        cfg[field] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=match) as e:
            ModelRunner(str(bad), dtype="fp32", device="cpu", kv_cache_tokens=64)
        assert "\n" not in str(e.value)


def test_lora_is_refused_in_one_line(moe_dirs):
    runner = ModelRunner(moe_dirs["mixtral"], dtype="fp32", device="cpu", kv_cache_tokens=64, fuse=False)
    with pytest.raises(ModelLoadError, match=r"option.enable_lora is not supported for mixture-of-experts models "
                                             r"\(mixtral"):
        runner.enable_lora(2, 8, 4)


def test_moe_outside_ours_names_the_field(moe_dirs, demo_model_dir, tmp_path):
    import transformers
    # an MoE family we do not implement: transformers serves it under auto; lmi refuses naming model_type
    cfg = transformers.GraniteMoeConfig(vocab_size=json.load(open(os.path.join(demo_model_dir, "config.json")))[
        "vocab_size"], hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    d = tmp_path / "granitemoe"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    _tokenizer_files(demo_model_dir, str(d))
    with pytest.raises(ModelLoadError, match=r"model_impl=lmi: .*model_type 'granitemoe'") as e:
        ModelRunner(str(d), dtype="fp32", device="cpu", kv_cache_tokens=64, model_impl="lmi")
    assert "\n" not in str(e.value)
    assert not ModelRunner(str(d), dtype="fp32", device="cpu", kv_cache_tokens=64).own
    # one of ours with a setting our layers do not have
    bad = tmp_path / "olmoe-clip"
    shutil.copytree(moe_dirs["olmoe"], bad)
    c = json.loads((bad / "config.json").read_text())
    c["clip_qkv"] = 8.0
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelLoadError, match=r"olmoe clip_qkv"):
        ModelRunner(str(bad), dtype="fp32", device="cpu", kv_cache_tokens=64, model_impl="lmi")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_degree_2_greedy_parity_every_strategy(family, moe_dirs, tmp_path):
    """Two gloo ranks, each with half of every expert's intermediate dimension (and half the heads,
    OLMoE's q/k norms over the projection summed across ranks)."""
    from tests.model.test_tp import _run_parity
    from tests.support.tp_parity import NEW_TP
    model_dir = moe_dirs[family]
    out = _run_parity(model_dir, tmp_path)
    assert out["kv_heads_per_rank"] == 1
    for strategy in STRATEGIES:
        for prompt, n, ids in zip(PROMPTS, NEW_TP, out[strategy]):
            assert ids == hf_greedy(model_dir, prompt, n), (family, strategy, prompt[:20])


# ---------------------------------------------------------------------------- GGUF expert blocks
GGUF_KINDS = ["Q4_K", "Q6_K", "Q8_0", "Q5_K"]


def _gguf_moe(family: str, root, demo_dir: str) -> str:
    """A tiny `family` (widths multiples of 256 for the K-quants) written as a GGUF file whose experts are
    3-D ffn_{gate,up,down}_exps tensors of K-quant / Q8_0 blocks (qwen2moe: and the shared expert's
    ffn_*_shexp), and its fp32 directory holding the gguf package's dequantized weights
    (converted_from.json naming the file, as handler/model/gguf.py leaves it)."""
    import gguf
    from gguf import quants
    from safetensors.torch import load_file, save_file
    from handler.model import quant_formats as qf
    from tests.model.test_gguf_blocks import _raw

    over = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                intermediate_size=512, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":
        over.update(shared_expert_intermediate_size=256, decoder_sparse_step=1, num_experts_per_tok=2)
    else:
        over.update(head_dim=64, mlp_only_layers=[1])
    d = build(family, str(root / "fp32"), demo_dir, **over)
    sd = load_file(os.path.join(d, "model.safetensors"))
    path = str(root / f"tiny-{family}.gguf")
    arch = family.replace("_", "")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.expert_count", 4)
    writer.add_uint32(f"{arch}.expert_used_count", 2)
    rng = np.random.default_rng(0)
    names = {v: k for k, v in qf.GGUF_LINEARS.items()}
    exps = {v: k for k, v in qf.GGUF_EXPERTS.items()}
    n = 0

    def blocks(key):
        nonlocal n
        kind = GGUF_KINDS[n % len(GGUF_KINDS)]
        n += 1
        qt = getattr(gguf.GGMLQuantizationType, kind)
        raw = _raw(kind, sd[key].numpy(), rng)
        sd[key] = torch.from_numpy(quants.dequantize(raw, qt)).contiguous()
        return raw, qt

    for i in range(2):
        for key in sorted(k for k in sd if k.startswith(f"model.layers.{i}.")):
            leaf = key.removeprefix(f"model.layers.{i}.").removesuffix(".weight")
            if leaf in names:
                raw, qt = blocks(key)
                writer.add_tensor(f"blk.{i}.{names[leaf]}.weight", raw, raw_shape=raw.shape, raw_dtype=qt)
        for proj, gname in exps.items():
            keys = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(4)]
            if keys[0] not in sd:
                continue
            kind = GGUF_KINDS[n % len(GGUF_KINDS)]
            n += 1
            qt = getattr(gguf.GGMLQuantizationType, kind)
            raws = [_raw(kind, sd[k].numpy(), rng) for k in keys]
            for k, raw in zip(keys, raws):
                sd[k] = torch.from_numpy(quants.dequantize(raw, qt)).contiguous()
            raw = np.stack(raws)
            writer.add_tensor(f"blk.{i}.{gname}.weight", raw, raw_shape=raw.shape, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "converted_from.json"), "w") as f:
        json.dump({"gguf": path}, f)
    return d


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_gguf_expert_blocks_give_the_dequantized_models_logits_bit_for_bit(family, demo_model_dir, tmp_path):
    pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
    from kernels import cpu as cpu_ext
    from handler.model.quant_int4 import is_grouped
    if not cpu_ext.gemm_q_available() or not cpu_ext.gemm_available():
        pytest.skip("bit-for-bit needs the grouped kernel and the fp32 panel GEMM (kernels/cpu/); this build has "
                    "neither")
    d = _gguf_moe(family, tmp_path, demo_model_dir)
    served = ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=128, quantize="gguf")
    served.prepack_cpu()
    plain = ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=128)
    plain.prepack_cpu()
    mlp = served.model.model.layers[0].mlp
    experts = [p for e in mlp.experts for p in (e.gate_proj, e.up_proj, e.down_proj)]
    assert all(is_grouped(m) for m in experts)      # kept packed per expert
    assert {m.pack.fmt for m in experts} <= {f"gguf {k}" for k in GGUF_KINDS}
    if family == "qwen2_moe":
        assert is_grouped(mlp.shared_expert.down_proj)
    assert not any(is_grouped(m) for m in plain.model.modules())
    for got, want in zip(_step_logits(served), _step_logits(plain)):
        assert torch.equal(got, want), (family, (got - want).abs().max().item())


# ---------------------------------------------------------------------------- sizing
def _hf_counts(model_dir: str) -> tuple[int, int]:
    """(weights of 2-D and 3-D tensors, one expert's of a sparse layer) of transformers' model."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = sum(p.numel() for p in m.parameters() if p.dim() >= 2)
    ex = next(x for x in m.modules() if type(x).__name__.endswith("Experts"))
    return total, ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()


@pytest.mark.parametrize("family", FAMILIES)
def test_sizing_counts_every_expert_and_the_active_ones(family, moe_dirs, tmp_path):
    from handler.config import load_config, sizing
    from handler.config.explain import explain, read_geometry, render
    d = moe_dirs[family]
    total, per_expert = _hf_counts(d)
    cls, kw = CONFIGS[family]
    w = sizing.moe_weights(sizing.read_config(d), 4)
    assert w["total_params"] == total
    sparse = {"qwen3_moe": 2, "qwen2_moe": 1}.get(family, 3)
    embedding = 8192 * 64       # a token reads one row of it: not counted as active
    assert w["active_params"] == total - sparse * (w["experts"] - w["top_k"]) * per_expert - embedding
    assert w["total_bytes"] == 4 * total
    props = tmp_path / "p.properties"
    props.write_text("option.rolling_batch=auto\noption.dtype=fp32\n")
    e = explain(load_config(str(props), d, env={}, gpu_count=0), read_geometry(d), device="cpu", model_dir=d)
    assert e["moe"]["active_bytes_per_token"] == 4 * w["active_params"]
    assert f"{w['experts']} experts, top-{w['top_k']}" in render(e)


def test_a_model_that_does_not_fit_is_refused_at_start_with_both_numbers(moe_dirs, monkeypatch):
    from handler.config import hardware
    d = moe_dirs["qwen2_moe"]
    total, per_expert = _hf_counts(d)
    monkeypatch.setattr(hardware, "cpu_available_memory", lambda: 4 * total - 1)
    with pytest.raises(ModelLoadError) as e:
        ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=64)
    msg = str(e.value)
    assert "\n" not in msg and f"need {4 * total:,} bytes" in msg
    assert f"reads {4 * (total - 5 * per_expert - 8192 * 64):,} bytes a token" in msg and f"{4 * total - 1:,} bytes" in msg
    monkeypatch.setattr(hardware, "cpu_available_memory", lambda: 4 * total)
    assert ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=64).own


def test_a_gguf_moe_that_cannot_be_dequantized_in_memory_is_refused_before_converting(demo_model_dir, tmp_path,
                                                                                    monkeypatch):
    pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
    from handler.config import hardware
    from handler.model.gguf import GGUFError, hf_dir_for
    _gguf_moe("qwen3_moe", tmp_path, demo_model_dir)
    path = str(tmp_path / "tiny-qwen3_moe.gguf")
    from gguf import GGUFReader
    tensors = GGUFReader(path).tensors
    total = 4 * sum(int(t.n_elements) for t in tensors)      # fp32, every weight the file holds
    exps = 4 * sum(int(t.n_elements) for t in tensors if "_exps" in t.name)
    monkeypatch.setattr(hardware, "cpu_available_memory", lambda: total - 1)
    with pytest.raises(GGUFError) as e:
        hf_dir_for(path, "fp32", "cpu")
    msg = str(e.value)
    assert "\n" not in msg and f"needs {total:,} bytes" in msg and f"reads {total - exps // 2:,} bytes" in msg
    cache = os.path.join(os.environ["LMI_MODEL_CACHE"], "gguf")
    assert not os.path.isdir(cache) or not os.listdir(cache)      # nothing converted


# ---------------------------------------------------------------------------- the 48-layer Qwen3-30B-A3B shape
# Qwen3-30B-A3B's config.json (the shape of the benchmark at its full depth), and its published
# parameter count: 30,532,122,624 (the checkpoint's safetensors index), of which the RMSNorm weights
# (2 x 2048 + 2 x 128 q/k a layer, 48 layers, + the final 2048 = 210,944) are not in what sizing counts
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                     decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, hidden_act="silu", torch_dtype="bfloat16")
QWEN3_30B_A3B_PARAMS, QWEN3_30B_A3B_NORMS = 30_532_122_624, 48 * (2 * 2048 + 2 * 128) + 2048
HOST_MEMORY = 24 * 2 ** 30      # this project's host (2 vCPUs, 24 GiB)


def _meminfo(tmp_path, available: int) -> str:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: {available // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    return str(p)


def test_the_48_layer_30b_a3b_shape_is_refused_at_start_with_the_bytes_it_needs(demo_model_dir, tmp_path,
                                                                                monkeypatch):
    # config.json only (no weights: nothing is read before the check); 24 GiB available as on this host
    d = tmp_path / "qwen3-30b-a3b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    _tokenizer_files(demo_model_dir, str(d))
    monkeypatch.setenv("LMI_MEMINFO", _meminfo(tmp_path, HOST_MEMORY))
    monkeypatch.setenv("LMI_CGROUP_ROOT", str(tmp_path / "no-cgroup"))
    counted = QWEN3_30B_A3B_PARAMS - QWEN3_30B_A3B_NORMS
    for dtype, size in (("bf16", 2), ("fp32", 4)):
        with pytest.raises(ModelLoadError) as e:
            ModelRunner(str(d), dtype=dtype, device="cpu", kv_cache_tokens=64)
        msg = str(e.value)
        assert "\n" not in msg and f"need {size * counted:,} bytes" in msg, msg
        assert f"{HOST_MEMORY:,} bytes (24.00 GiB) are available" in msg and "top-8 experts" in msg, msg


def test_the_48_layer_30b_a3b_q4_k_m_gguf_is_refused_before_it_is_dequantized(tmp_path, monkeypatch):
    # The file a user would serve: the 48-layer shape as llama.cpp's Q4_K_M lays it out (Q4_K, Q6_K on
    # ffn_down / attn_v of llama.cpp's "more bits" layers and the head; fp32 norms), written sparse (the
    # header and tensor table real, the 18 GB of blocks a hole on disk). Start-up would dequantize it to
    # the served dtype first: refused with that size before anything is converted.
    gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
    from handler.model.gguf import GGUFError, hf_dir_for
    c = QWEN3_30B_A3B
    h, n, x, w, d = c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["moe_intermediate_size"], 128
    q4k, q6k, f32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F32
    tensors = [("token_embd.weight", (c["vocab_size"], h), q4k), ("output_norm.weight", (h,), f32),
               ("output.weight", (c["vocab_size"], h), q6k)]
    for i in range(n):
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2    # llama.cpp's use_more_bits
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (h,), f32), (b + "ffn_norm.weight", (h,), f32),
                    (b + "attn_q_norm.weight", (d,), f32), (b + "attn_k_norm.weight", (d,), f32),
                    (b + "attn_q.weight", (32 * d, h), q4k), (b + "attn_k.weight", (4 * d, h), q4k),
                    (b + "attn_v.weight", (4 * d, h), q6k if more else q4k), (b + "attn_output.weight", (h, 32 * d), q4k),
                    (b + "ffn_gate_inp.weight", (x, h), f32), (b + "ffn_gate_exps.weight", (x, w, h), q4k),
                    (b + "ffn_up_exps.weight", (x, w, h), q4k),
                    (b + "ffn_down_exps.weight", (x, h, w), q6k if more else q4k)]
    path = str(tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_uint32("qwen3moe.block_count", n)
    writer.add_uint32("qwen3moe.expert_count", x)
    writer.add_uint32("qwen3moe.expert_used_count", c["num_experts_per_tok"])
    data = 0
    for name, shape, qt in tensors:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(shape)) // block * size
        writer.add_tensor_info(name, shape, np.float32, nbytes, raw_dtype=qt)
        data += -(-nbytes // 32) * 32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    os.truncate(path, -(-os.path.getsize(path) // 32) * 32 + data)
    assert 17e9 < os.path.getsize(path) < 19e9 and os.stat(path).st_blocks * 512 < 2 ** 20   # ~18 GB, none on disk
    monkeypatch.setenv("LMI_MEMINFO", _meminfo(tmp_path, HOST_MEMORY))
    monkeypatch.setenv("LMI_CGROUP_ROOT", str(tmp_path / "no-cgroup"))
    monkeypatch.setenv("LMI_MODEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(GGUFError) as e:
        hf_dir_for(path, "bf16", "cpu")
    msg = str(e.value)
    # every weight the file holds, at 2 bytes (the published count: norms included, in the file too)
    assert "\n" not in msg and f"dequantized needs {2 * QWEN3_30B_A3B_PARAMS:,} bytes" in msg, msg
    assert "top-8 experts" in msg and f"{HOST_MEMORY:,} bytes (24.00 GiB) are available" in msg, msg
    assert not os.path.isdir(tmp_path / "cache" / "gguf") or not os.listdir(tmp_path / "cache" / "gguf")
