"""handler/model/cpu.py: oneDNN weight prepacking, the head-major CPU KV pool and the tcmalloc re-exec."""
from __future__ import annotations

import os
import pytest
import torch
from torch import nn

from handler.model import cpu
from handler.model.cpu import PackedLinear, PanelLinear, WidenedLinear, find_tcmalloc, preload_env, prepack_linears
from kernels import cpu_ext

needs_panels = pytest.mark.skipif(not cpu_ext.gemm_available(),
                                  reason="kernels/cpu_gemm.c needs AVX-512F and a C compiler")


def _classes(gemm: str):
    """(the fp32 class, the widened bf16 class) prepack_linears picks under LMI_CPU_GEMM=gemm."""
    return (PanelLinear, PanelLinear) if gemm == "panels" else (PackedLinear, WidenedLinear)


def _load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_prepacked_model_gives_the_plain_models_logits(demo_model_factory, monkeypatch, gemm, dtype, tol):
    if not cpu.can_prepack(dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU")
    monkeypatch.setenv("LMI_CPU_GEMM", gemm)
    path = demo_model_factory("llama")
    plain, packed = _load(path, dtype), _load(path, dtype)
    n = prepack_linears(packed)
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    want_cls = _classes(gemm)[0] if dtype == torch.float32 else PackedLinear   # bf16 unwidened: oneDNN's
    assert n == len(linears) > 0 and all(type(m) is want_cls for m in linears)
    ids = torch.randint(5, plain.config.vocab_size, (2, 13))
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), packed(ids).logits.float()
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
def test_widened_bf16_linear_is_the_exact_products_summed_and_rounded_once(monkeypatch, gemm):
    # Oracle: float64 math on the same bf16 values, rounded to bf16 once. The widened GEMM
    # (fp32 sum of exact products) lands on it or one bf16 step away where the fp32 sum order
    # decides a rounding; the bf16 GEMM oneDNN runs obeys the same bound.
    if not cpu.can_prepack(torch.float32):
        pytest.skip("oneDNN cannot prepack on this CPU")
    monkeypatch.setenv("LMI_CPU_GEMM", gemm)
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(300, 70, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 300, generator=g))
        lin.bias.copy_(torch.randn(70, generator=g))
    x = torch.randn(33, 300, generator=g).to(torch.bfloat16)
    want = (x.double() @ lin.weight.double().t() + lin.bias.double()).to(torch.bfloat16)
    model = nn.Sequential(lin)
    assert prepack_linears(model, widen_bf16=True) == 1 and type(lin) is _classes(gemm)[1]
    packed = lin.panels if gemm == "panels" else lin.packed
    assert packed.dtype == torch.float32 and lin.weight.numel() == 0
    with torch.inference_mode():
        got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs().clamp_min(1e-30) * 2 ** -7
    assert ((got.float() - want.float()).abs() <= step * 1.01).all()
    assert (got == want).float().mean().item() > 0.98
    with pytest.raises(RuntimeError, match="input dtype"):
        lin(x.float())


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])     # qwen2: q/k/v with a bias
def test_widened_model_gives_the_bf16_models_greedy_tokens(demo_model_factory, monkeypatch, family, gemm):
    # Widened and bf16 GEMMs sum in different orders, so an activation may round one bf16 step
    # apart: the logits stay within bf16 noise, and the greedy token differs only where the top
    # two logits are within that noise of each other (random weights give a few such near-ties).
    monkeypatch.setenv("LMI_CPU_GEMM", gemm)
    path = demo_model_factory(family)
    plain, widened = _load(path, torch.bfloat16), _load(path, torch.bfloat16)
    n = prepack_linears(widened, widen_bf16=True)
    linears = [m for m in widened.modules() if isinstance(m, nn.Linear)]
    assert n == len(linears) > 0 and all(type(m) is _classes(gemm)[1] for m in linears)
    ids = torch.randint(5, plain.config.vocab_size, (4, 13), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), widened(ids).logits.float()
    noise = 0.1 * max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= noise
    differ = got.argmax(-1) != want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1])[differ] <= 2 * noise).all()
    assert differ.float().mean().item() <= 0.05


def test_bf16_gemm_choice_follows_the_switch_the_timing_and_the_memory(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64)).to(torch.bfloat16)
    monkeypatch.setenv("LMI_CPU_BF16_GEMM", "fp32")
    assert cpu.bf16_gemm_in_fp32(model) == (True, "LMI_CPU_BF16_GEMM=fp32")
    monkeypatch.setenv("LMI_CPU_BF16_GEMM", "bf16")
    assert cpu.bf16_gemm_in_fp32(model)[0] is False
    monkeypatch.setenv("LMI_CPU_BF16_GEMM", "auto")
    timed = []

    def fake(rows, k, n, dtype, reps=5):
        timed.append((rows, k, n))
        return {torch.bfloat16: bf16_s[rows], torch.float32: 1.0}[dtype]
    monkeypatch.setattr(cpu, "_gemm_seconds", fake)
    for bf16_s, widen in (({64: 1.7, 512: 1.6}, True), ({64: 1.7, 512: 1.1}, False),
                          ({64: 0.5, 512: 0.5}, False)):
        cpu._bf16_over_fp32.cache_clear()
        got, why = cpu.bf16_gemm_in_fp32(model)
        assert got is widen and "64x96" in why     # the widest weight, [96, 64]: k=64, n=96
    assert {(r, k, n) for r, k, n in timed} == {(64, 64, 96), (512, 64, 96)}
    monkeypatch.setattr(cpu, "_mem_available", lambda: 4 * 4 * (64 * 96 * 2) - 1)
    got, why = cpu.bf16_gemm_in_fp32(model)
    assert got is False and "quarter of the memory" in why
    assert cpu.bf16_gemm_in_fp32(nn.Sequential(nn.Linear(4, 4)))[0] is False   # fp32 model
    monkeypatch.setattr(cpu, "_mem_available", lambda: None)
    monkeypatch.setenv("LMI_CPU_BF16_GEMM", "fp16")          # not a choice: said, then timed
    got, why = cpu.bf16_gemm_in_fp32(model)
    assert got is False and "'fp16' ignored (auto, bf16 or fp32)" in why and "64x96" in why
    monkeypatch.setenv("LMI_CPU_BF16_GEMM", "fp32")
    monkeypatch.setenv("LMI_CPU_PREPACK", "0")                # nothing is packed: nothing widens
    got, why = cpu.bf16_gemm_in_fp32(model)
    assert got is False and "LMI_CPU_PREPACK=0" in why
    cpu._bf16_over_fp32.cache_clear()


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_bf16_gemm_timing_measures_both_paths(monkeypatch, onednn_bf16):
    # Without oneDNN's bf16 (an older CPU), the bf16 side is the plain layer's F.linear and
    # widening still packs the fp32 copies.
    if not cpu.can_prepack(torch.float32) or (onednn_bf16 and not cpu.can_prepack(torch.bfloat16)):
        pytest.skip("oneDNN cannot prepack on this CPU")
    real = cpu.can_prepack
    monkeypatch.setattr(cpu, "can_prepack", lambda dt: real(dt) and (onednn_bf16 or dt != torch.bfloat16))
    for dtype in (torch.bfloat16, torch.float32):
        s = cpu._gemm_seconds(8, 32, 48, dtype, reps=2)
        assert 0 < s < 1
    model = nn.Sequential(nn.Linear(32, 48)).to(torch.bfloat16)
    widened = PanelLinear if cpu.panels_wanted() else WidenedLinear
    assert prepack_linears(model, widen_bf16=True) == 1 and type(model[0]) is widened
    plain = nn.Sequential(nn.Linear(32, 48)).to(torch.bfloat16)
    assert prepack_linears(plain) == (1 if onednn_bf16 else 0)


def test_prepacking_drops_only_weights_nobody_else_holds(demo_model_factory):
    model = _load(demo_model_factory("llama"))
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    q = model.model.layers[0].self_attn.q_proj
    prepack_linears(model)
    assert q.weight.numel() == 0 and q.in_features > 0        # replaced by its packed copy
    if tied:    # the embedding still reads the shared weight
        assert head.weight.numel() == model.get_input_embeddings().weight.numel() > 0
    kept = _load(demo_model_factory("llama"))
    prepack_linears(kept, keep_weights=True)                  # LoRA reads the weights
    assert kept.model.layers[0].self_attn.q_proj.weight.shape == (q.out_features, q.in_features)


def test_prepacking_switch(demo_model_factory, monkeypatch):
    monkeypatch.setenv("LMI_CPU_PREPACK", "0")
    model = _load(demo_model_factory("llama"))
    assert prepack_linears(model) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())


def test_runner_pool_is_head_major_on_cpu_and_switchable(demo_model_factory, monkeypatch):
    from handler.model.runner import ModelRunner
    from kernels.reference import head_major

    path = demo_model_factory("llama")
    r = ModelRunner(path, kv_cache_tokens=64, block_size=4)
    k = r.kv_cache[0][0]
    assert k.shape == (16, 4, r.kv.num_kv_heads, r.kv.head_dim)   # every reader's view
    assert head_major(k) and not k.is_contiguous()
    monkeypatch.setenv("LMI_CPU_KV_LAYOUT", "token")
    r2 = ModelRunner(path, kv_cache_tokens=64, block_size=4)
    assert r2.kv_cache[0][0].is_contiguous()


def test_preload_env(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    dirs = (str(tmp_path),)
    env = preload_env({"PATH": "/bin"}, dirs)
    assert env["LD_PRELOAD"] == str(lib) and env["PATH"] == "/bin"
    assert preload_env({"LD_PRELOAD": "/x/libfoo.so"}, dirs)["LD_PRELOAD"] == f"{lib}:/x/libfoo.so"
    assert preload_env({"LD_PRELOAD": str(lib)}, dirs) is None           # already: no loop
    assert preload_env({"LMI_CPU_MALLOC": "system"}, dirs) is None       # opted out
    assert preload_env({}, (str(tmp_path / "none"),)) is None            # absent: serve as is


def test_server_runs_with_tcmalloc_when_the_system_has_it(demo_model_factory, tmp_path):
    lib = find_tcmalloc()
    if lib is None:
        pytest.skip("no tcmalloc on this machine (Debian: apt-get install libtcmalloc-minimal4)")
    from tests.support.server import Server
    srv = Server("option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=4\n",
                 demo_model_factory("llama"), tmp_path, env={"LD_PRELOAD": "", "LMI_CPU_MALLOC": "tcmalloc"})
    try:
        with open(f"/proc/{srv.proc.pid}/maps") as f:     # the re-executed process keeps its pid
            assert os.path.basename(lib) in f.read()
        r = srv.post({"inputs": "hello there", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norms_give_the_models_own_values(demo_model_factory, family, dtype):
    # fp32 (torch's fused rms_norm): bit for bit. bf16 (the C kernel, its own fp32 sum order):
    # an element may land one bf16 step away, and the logits stay within bf16 noise.
    plain, fused = _load(demo_model_factory(family), dtype), _load(demo_model_factory(family), dtype)
    n = cpu.fuse_rms_norms(fused)
    norms = [m for m in fused.modules() if type(m).__name__.endswith("RMSNorm")]
    assert n == len(norms)                 # every Llama-style norm of these families, gpt2 has none
    assert (n > 0) == (family != "gpt2")
    for m in norms:                         # random weights, so a dropped weight product would show
        with torch.no_grad():
            m.weight.normal_()
    for a, b in zip(plain.modules(), fused.modules()):
        if type(a).__name__.endswith("RMSNorm"):
            with torch.no_grad():
                a.weight.copy_(b.weight)
    ids = torch.randint(5, plain.config.vocab_size, (2, 17))
    with torch.inference_mode():
        for a, b in zip([m for m in plain.modules() if type(m).__name__.endswith("RMSNorm")], norms):
            x = torch.randn(3, 7, a.weight.numel()).to(dtype) * 3    # Qwen3's q/k norms: head_dim wide
            got, want = b(x), a(x)
            if dtype == torch.float32:
                assert torch.equal(got, want)
            else:
                step = want.float().abs().clamp_min(1e-30) * 2 ** -7     # one bf16 step (8 bits of mantissa)
                assert ((got.float() - want.float()).abs() <= step * 1.01).all()
                assert (got != want).float().mean().item() < 0.02
        got, want = fused(ids).logits, plain(ids).logits
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            assert (got.float() - want.float()).abs().max().item() <= 0.05 * max(1.0, want.float().abs().max().item())


def test_rms_norms_written_otherwise_keep_their_forward(monkeypatch):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm   # (1 + weight): not Llama's
    model = nn.Sequential(GemmaRMSNorm(16))
    assert cpu.fuse_rms_norms(model) == 0 and "forward" not in vars(model[0])
    monkeypatch.setenv("LMI_CPU_FUSED_NORM", "0")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    assert cpu.fuse_rms_norms(nn.Sequential(LlamaRMSNorm(16))) == 0


def _runner(model_dir, dtype, monkeypatch, fused: bool):
    from handler.model.runner import ModelRunner
    monkeypatch.setenv("LMI_CPU_FUSED_LAYERS", "1" if fused else "0")
    r = ModelRunner(model_dir, dtype=dtype, device="cpu", block_size=4, kv_cache_tokens=256, max_running=8)
    r.prepack_cpu()
    return r


@pytest.mark.parametrize("family,attn_fused", [("llama", True), ("qwen2", True), ("qwen3", False), ("gpt2", False)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_llama_layers_give_the_same_logits(demo_model_factory, monkeypatch, family, attn_fused, dtype):
    # Oracle: the same runner with the models' own forwards (LMI_CPU_FUSED_LAYERS=0), on a step
    # of two prefills, then a mixed step (two decode rows and a third prompt). The fused
    # attention's rotary rounds as transformers' does and its MLP runs the same ops in place, so
    # the logits are equal bit for bit, in bf16 too.
    from handler.model.cpu import fuse_llama_layers
    path = demo_model_factory(family)
    plain, fused = _runner(path, dtype, monkeypatch, False), _runner(path, dtype, monkeypatch, True)
    layers = plain.model.config.num_hidden_layers
    attn = [m for m in fused.model.modules() if "forward" in vars(m) and hasattr(m, "q_proj")]
    mlps = [m for m in fused.model.modules() if "forward" in vars(m) and hasattr(m, "gate_proj")]
    assert len(attn) == (layers if attn_fused else 0) and len(mlps) == (0 if family == "gpt2" else layers)
    assert not any("forward" in vars(m) for m in plain.model.modules() if hasattr(m, "q_proj"))
    monkeypatch.setenv("LMI_CPU_FUSED_LAYERS", "0")
    assert fuse_llama_layers(fused.model) == (0, 0)                  # the switch
    _assert_same_logits(plain, fused)


def _assert_same_logits(plain, fused):
    """Two prefills, then a mixed step (two decode rows and a third prompt), then two decodes."""
    from handler.engine.request import SamplingParams
    from handler.model.runner import pack_step
    from handler.engine.scheduler import StepItem
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(max_new_tokens=4)
    a, b, c = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 5, 7))
    steps = [[StepItem(1, a, 0, [0, 1, 2], True, p, a), StepItem(2, b, 0, [3, 4], True, p, b)],
             [StepItem(1, [17], 9, [0, 1, 2], True, p, a + [17]), StepItem(2, [23], 5, [3, 4], True, p, b + [23]),
              StepItem(3, c, 0, [5, 6], True, p, c)],
             [StepItem(1, [4], 10, [0, 1, 2], True, p, a + [17, 4]), StepItem(3, [9], 7, [5, 6], True, p, c + [9])]]
    for items in steps:
        packed, _ = pack_step(items, 4)
        want, got = plain.forward(packed), fused.forward(packed)
        assert want.shape[0] == len(items) and torch.equal(got, want)


def test_fused_attention_without_the_c_kernels_uses_transformers_rotary(demo_model_factory, monkeypatch):
    # No kernel library (LMI_CPU_ATTENTION=reference): the fused forward still serves, with the
    # module's own apply_rotary_pos_emb, and gives the same logits.
    from kernels import cpu_ext
    monkeypatch.setenv("LMI_CPU_ATTENTION", "reference")
    cpu_ext.load.cache_clear()
    try:
        path = demo_model_factory("llama")
        plain, fused = _runner(path, "fp32", monkeypatch, False), _runner(path, "fp32", monkeypatch, True)
        assert any("forward" in vars(m) for m in fused.model.modules() if hasattr(m, "q_proj"))
        assert cpu_ext.load() is None
        _assert_same_logits(plain, fused)
    finally:
        cpu_ext.load.cache_clear()


def test_attention_source_check_takes_llamas_forward_and_its_sliding_window_variants():
    # The fused forward replaces only a forward that is Llama's (plus Mistral's or Qwen2's window
    # line, which the fused forward then passes on); anything computed differently keeps its own.
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    m = SimpleNamespace(sliding_window=7, config=SimpleNamespace(sliding_window=5))
    assert cpu._window_of(LlamaAttention)(m) is None
    assert cpu._window_of(MistralAttention)(m) == 5          # from the config
    assert cpu._window_of(Qwen2Attention)(m) == 7            # the module's own (per layer type)
    assert cpu._window_of(Qwen3Attention) is None            # q/k norms
    assert cpu._window_of(Gemma2Attention) is None           # soft-cap

    class Edited(LlamaAttention):                             # one changed line: not Llama's
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            return super().forward(hidden_states * 2, position_embeddings, attention_mask, **kwargs)
    assert cpu._window_of(Edited) is None


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
@pytest.mark.parametrize("dtype,setting,widened", [("bf16", "fp32", True), ("bf16", "bf16", False),
                                                   ("fp32", "fp32", False)])
def test_runner_packs_bf16_linears_as_the_gemm_choice_says(demo_model_factory, monkeypatch, dtype, setting,
                                                           widened, gemm):
    if not cpu.can_prepack(torch.bfloat16):
        pytest.skip("oneDNN cannot prepack bf16 on this CPU")
    monkeypatch.setenv("LMI_CPU_BF16_GEMM", setting)
    monkeypatch.setenv("LMI_CPU_GEMM", gemm)
    r = _runner(demo_model_factory("llama"), dtype, monkeypatch, True)
    fp32_cls, widened_cls = _classes(gemm)
    want = widened_cls if widened else PackedLinear if dtype == "bf16" else fp32_cls
    linears = [m for m in r.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is want for m in linears)
    assert all(m.widen is widened for m in linears if type(m) is PanelLinear)


def _lean_runner(model_dir, dtype, monkeypatch, on: bool):
    monkeypatch.setenv("LMI_CPU_LEAN_FORWARD", "1" if on else "0")
    return _runner(model_dir, dtype, monkeypatch, True)


@pytest.mark.parametrize("family,qualifies", [("llama", True), ("qwen2", True), ("qwen3", True), ("gpt2", False)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_loop_forward_gives_the_models_own_logits(demo_model_factory, monkeypatch, family, qualifies, dtype):
    # Oracle: the same runner with the model's own forward (LMI_CPU_LEAN_FORWARD=0), bit for bit
    # on prefills, a mixed step and decodes. Qwen3's attention is its own (q/k norms): the loop
    # calls it as the decoder layer would. GPT-2's layers are not Llama's: no loop.
    path = demo_model_factory(family)
    plain, fast = _lean_runner(path, dtype, monkeypatch, False), _lean_runner(path, dtype, monkeypatch, True)
    assert plain.lean is None and (fast.lean is not None) == qualifies
    calls = []
    if qualifies:
        loop = fast.lean
        fast.lean = lambda *a: calls.append(1) or loop(*a)
    _assert_same_logits(plain, fast)
    assert len(calls) == (3 if qualifies else 0)      # each of its three steps ran through the loop


def test_one_loop_forward_is_refused_where_the_models_outer_forward_differs(demo_model_factory, monkeypatch,
                                                                              caplog):
    # Layers and head are Llama's, but the model's own forward does more (here: doubles the
    # embeddings), which the loop does not know: the load-time check catches it and the model's
    # own forward serves.
    import logging

    from transformers.models.llama.modeling_llama import LlamaModel
    own = LlamaModel.forward

    def doubled(self, input_ids=None, inputs_embeds=None, **kwargs):
        return own(self, inputs_embeds=self.embed_tokens(input_ids) * 2, **kwargs)
    monkeypatch.setattr(LlamaModel, "forward", doubled)
    path = demo_model_factory("llama")
    assert cpu.lean_forward(_load(path)) is not None      # the source checks alone would take it
    with caplog.at_level(logging.WARNING, logger="lmi.runner"):
        r = _lean_runner(path, "fp32", monkeypatch, True)
    assert r.lean is None
    assert any("not used" in rec.getMessage() for rec in caplog.records)
    monkeypatch.setattr(LlamaModel, "forward", own)
    other = _lean_runner(path, "fp32", monkeypatch, True)
    assert other.lean is not None
    from handler.engine.request import SamplingParams
    from handler.model.runner import pack_step
    from handler.engine.scheduler import StepItem
    items = [StepItem(1, [5, 9, 11, 30], 0, [0], True, SamplingParams(max_new_tokens=2), [5, 9, 11, 30])]
    packed, _ = pack_step(items, 4)
    monkeypatch.setattr(LlamaModel, "forward", doubled)
    doubled_logits = r.forward(packed)
    monkeypatch.setattr(LlamaModel, "forward", own)
    assert not torch.equal(doubled_logits, other.forward(packed))   # r ran the model's (doubled) forward


def test_one_loop_forward_needs_no_hooks_and_follows_its_switch(demo_model_factory, monkeypatch):
    model = _load(demo_model_factory("llama"))
    monkeypatch.setenv("LMI_CPU_LEAN_FORWARD", "1")
    assert cpu.lean_forward(model) is not None
    handle = model.model.layers[2].mlp.register_forward_hook(lambda m, i, o: None)
    assert cpu.lean_forward(model) is None                # the loop would skip the hook
    handle.remove()
    assert cpu.lean_forward(model) is not None
    monkeypatch.setenv("LMI_CPU_LEAN_FORWARD", "0")
    assert cpu.lean_forward(model) is None


def test_gemm_setting_names_its_values_when_it_is_wrong(monkeypatch, caplog):
    import logging
    monkeypatch.setenv("LMI_CPU_GEMM", "onednn")
    assert cpu.panels_wanted() is False
    monkeypatch.setenv("LMI_CPU_GEMM", "mkl")
    with caplog.at_level(logging.WARNING, logger="lmi.cpu"):
        assert cpu.panels_wanted() is cpu_ext.gemm_available()
    assert any("LMI_CPU_GEMM='mkl' ignored (allowed: panels, onednn)" in r.getMessage() for r in caplog.records)
