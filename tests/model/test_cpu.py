"""handler/model/cpu.py: oneDNN weight prepacking, the head-major CPU KV pool and the tcmalloc re-exec."""
from __future__ import annotations

import os
import pytest
import torch
from torch import nn

from handler.model import cpu
from handler.model.cpu import Bf16PanelPack, OneDnnPack, PanelPack, find_tcmalloc, preload_env, prepack_linears
from handler.model.linear import CpuLinear
from kernels import cpu as cpu_ext

needs_panels = pytest.mark.skipif(not cpu_ext.gemm_available(),
                                  reason="kernels/cpu_gemm.c is not built here (the torch backend, or no C compiler)")
needs_bf16_panels = pytest.mark.skipif(not cpu_ext.gemm_bf16_available(),
                                       reason="kernels/cpu_gemm_bf16.c needs AVX512-BF16 and a C compiler")


# What multiplies a packed layer (its CpuLinear's pack, handler/model/linear.py)
ONEDNN, WIDENED, PANELS, BF16_PANELS = "onednn", "onednn widened", "panels", "bf16 panels"


def _kind(m: nn.Module) -> str:
    """A layer's pack as one of the names above (a plain layer: its class name)."""
    if not isinstance(m, CpuLinear):
        return type(m).__name__
    p = m.pack
    if isinstance(p, OneDnnPack):
        return WIDENED if p.widen else ONEDNN
    return {PanelPack: PANELS, Bf16PanelPack: BF16_PANELS}[type(p)]


def _classes(gemm: str):
    """(the fp32 kind, the widened bf16 kind) prepack_linears picks under the gemm arm: a
    widened bf16 weight stays bf16 where kernels/cpu_gemm_bf16.c widens it in registers."""
    if gemm != "panels":
        return ONEDNN, WIDENED
    return PANELS, BF16_PANELS if cpu_ext.gemm_bf16w_available() else PANELS


def _load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_prepacked_model_gives_the_plain_models_logits(demo_model_factory, gemm, dtype, tol):
    if not cpu.can_prepack(dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU")
    arms = cpu.Arms(gemm=gemm)
    path = demo_model_factory("llama")
    plain, packed = _load(path, dtype), _load(path, dtype)
    n = prepack_linears(packed, arms=arms)
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    want_cls = _classes(gemm)[0] if dtype == torch.float32 else ONEDNN   # bf16 unwidened: oneDNN's
    assert n == len(linears) > 0 and all(_kind(m) == want_cls for m in linears)
    ids = torch.randint(5, plain.config.vocab_size, (2, 13))
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), packed(ids).logits.float()
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
def test_widened_bf16_linear_is_the_exact_products_summed_and_rounded_once(gemm):
    # Oracle: float64 math on the same bf16 values, rounded to bf16 once. The widened GEMM
    # (fp32 sum of exact products) lands on it or one bf16 step away where the fp32 sum order
    # decides a rounding; the bf16 GEMM oneDNN runs obeys the same bound.
    if not cpu.can_prepack(torch.float32):
        pytest.skip("oneDNN cannot prepack on this CPU")
    arms = cpu.Arms(gemm=gemm)
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(300, 70, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 300, generator=g))
        lin.bias.copy_(torch.randn(70, generator=g))
    x = torch.randn(33, 300, generator=g).to(torch.bfloat16)
    want = (x.double() @ lin.weight.double().t() + lin.bias.double()).to(torch.bfloat16)
    model = nn.Sequential(lin)
    assert prepack_linears(model, widen_bf16=True, arms=arms) == 1 and _kind(model[0]) == _classes(gemm)[1]
    lin = model[0]
    packed = lin.pack.panels if gemm == "panels" else lin.pack.packed
    assert packed.dtype == (torch.bfloat16 if _kind(lin) == BF16_PANELS else torch.float32)
    assert lin.weight.numel() == 0
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
def test_widened_model_gives_the_bf16_models_greedy_tokens(demo_model_factory, family, gemm):
    # Widened and bf16 GEMMs sum in different orders, so an activation may round one bf16 step
    # apart: the logits stay within bf16 noise, and the greedy token differs only where the top
    # two logits are within that noise of each other (random weights give a few such near-ties).
    arms = cpu.Arms(gemm=gemm)
    path = demo_model_factory(family)
    plain, widened = _load(path, torch.bfloat16), _load(path, torch.bfloat16)
    n = prepack_linears(widened, widen_bf16=True, arms=arms)
    linears = [m for m in widened.modules() if isinstance(m, nn.Linear)]
    assert n == len(linears) > 0 and all(_kind(m) == _classes(gemm)[1] for m in linears)
    ids = torch.randint(5, plain.config.vocab_size, (4, 13), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), widened(ids).logits.float()
    noise = 0.1 * max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= noise
    differ = got.argmax(-1) != want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1])[differ] <= 2 * noise).all()
    assert differ.float().mean().item() <= 0.05


@needs_bf16_panels
def test_bf16_panel_linear_is_the_exact_products_summed_and_rounded_once():
    # Oracle as for the widened layer: float64 math on the same bf16 values, rounded to bf16 once;
    # the panels' fp32 sum (in pairs, another order) lands on it or one bf16 step away.
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(301, 70, bias=True).to(torch.bfloat16)     # odd K, N not a multiple of 32
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 301, generator=g))
        lin.bias.copy_(torch.randn(70, generator=g))
    x = torch.randn(33, 301, generator=g).to(torch.bfloat16)
    want = (x.double() @ lin.weight.double().t() + lin.bias.double()).to(torch.bfloat16)
    model = nn.Sequential(lin)
    assert prepack_linears(model, bf16_panels=True) == 1 and _kind(model[0]) == BF16_PANELS
    lin = model[0]
    assert lin.pack.panels.dtype == torch.bfloat16 and lin.weight.numel() == 0 and lin.bias32.dtype == torch.float32
    with torch.inference_mode():
        got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs().clamp_min(1e-30) * 2 ** -7
    assert ((got.float() - want.float()).abs() <= step * 1.01).all()
    assert (got == want).float().mean().item() > 0.98
    with pytest.raises(RuntimeError, match="input dtype"):
        lin(x.float())


@needs_bf16_panels
def test_bf16_panels_leave_fp32_layers_and_yield_to_the_switches():
    mixed = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32).to(torch.bfloat16))
    assert prepack_linears(mixed, bf16_panels=True) == 2
    assert _kind(mixed[0]) == _classes("panels" if cpu.panels_wanted() else "onednn")[0]   # fp32 as before
    assert _kind(mixed[1]) == BF16_PANELS
    onednn = cpu.Arms(gemm="onednn")              # no panel kernels at all
    model = nn.Sequential(nn.Linear(32, 48).to(torch.bfloat16))
    prepack_linears(model, bf16_panels=True, arms=onednn)
    assert _kind(model[0]) != BF16_PANELS
    assert cpu.bf16_panels_available(onednn) is False


@needs_bf16_panels
@pytest.mark.parametrize("family", ["llama", "qwen2"])     # qwen2: q/k/v with a bias
def test_bf16_panel_model_gives_the_bf16_models_greedy_tokens(demo_model_factory, family):
    # As the widened model: another summation order moves an activation by a bf16 step at most
    # now and then; logits within bf16 noise, the greedy token different only at near-ties.
    path = demo_model_factory(family)
    plain, ours = _load(path, torch.bfloat16), _load(path, torch.bfloat16)
    n = prepack_linears(ours, bf16_panels=True)
    linears = [m for m in ours.modules() if isinstance(m, nn.Linear)]
    assert n == len(linears) > 0 and all(_kind(m) == BF16_PANELS for m in linears)
    ids = torch.randint(5, plain.config.vocab_size, (4, 13), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), ours(ids).logits.float()
    noise = 0.1 * max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= noise
    differ = got.argmax(-1) != want.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1])[differ] <= 2 * noise).all()
    assert differ.float().mean().item() <= 0.05


@needs_bf16_panels
def test_real_model_on_bf16_panels_answers_like_onednn_bf16(real_model_dir, tmp_path):
    # SmolLM2-135M in bf16, our engine on the panels against transformers' generate on the
    # unpacked model (torch's bf16 GEMMs): the same greedy tokens, or a first difference at a
    # near-tie (tests/support/reference.near_tie_divergence); and the first step's logits close.
    from handler.engine.request import SamplingParams
    from tests.support.engine import make_engine, run_all
    from tests.support.reference import greedy_ids, model_on, near_tie_divergence
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Write a haiku about the sea.",
               "List three prime numbers:"]
    engine = make_engine(real_model_dir, tmp_path, {"option.rolling_batch": "auto", "option.paged_attention": "true",
                                                    "option.dtype": "bf16", "option.max_rolling_batch_size": "4"},
                         arms=cpu.Arms(bf16_gemm="panels"))
    try:
        linears = [m for m in engine.runner.model.modules() if isinstance(m, nn.Linear)]
        assert linears and all(_kind(m) == BF16_PANELS for m in linears)
        results = run_all(engine, prompts, [SamplingParams(max_new_tokens=16)] * len(prompts))
        runner = engine.runner
    finally:
        engine.shutdown()
    tok, model = model_on(real_model_dir, "cpu", torch.bfloat16)
    exact = 0
    for p, (got, _) in zip(prompts, results):
        ids = tok(p)["input_ids"]
        want = greedy_ids(model, tok, ids, 16)
        why = near_tie_divergence(model, ids, want, got, 0.1)
        assert why is None, (p, why)
        exact += got == want
    assert exact >= len(prompts) // 2, f"only {exact} of {len(prompts)} streams equal generate's"
    # One prompt's logits at every position: transformers' model on the panels against unpacked.
    ids = torch.tensor([tok(prompts[0])["input_ids"]])
    with torch.inference_mode():
        want = model(ids).logits[0].float()
        ours = _load(real_model_dir, torch.bfloat16)
        prepack_linears(ours, bf16_panels=True)
        got = ours(ids).logits[0].float()
    assert runner.dtype == torch.bfloat16
    assert (got - want).abs().max().item() <= 0.1 * max(1.0, want.abs().max().item())


@pytest.mark.skipif(not cpu_ext.gemm_bf16w_available(), reason="kernels/cpu_gemm_bf16.c needs AVX-512F/BW")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_widening_in_registers_gives_the_fp32_copys_logits_bit_for_bit(demo_model_factory, monkeypatch, family):
    # Same products, same k order, same FMAs: only where the widened weight lives differs.
    path = demo_model_factory(family)
    copy, ours = _load(path, torch.bfloat16), _load(path, torch.bfloat16)
    monkeypatch.setattr(cpu_ext, "gemm_bf16w_available", lambda: False)
    prepack_linears(copy, widen_bf16=True)
    monkeypatch.undo()
    prepack_linears(ours, widen_bf16=True)
    lin = [m for m in ours.modules() if isinstance(m, nn.Linear)]
    assert lin and all(_kind(m) == BF16_PANELS and m.pack.widen and m.pack.panels.dtype == torch.bfloat16
                   for m in lin)
    assert all(_kind(m) == PANELS and m.pack.panels.dtype == torch.float32
               for m in copy.modules() if isinstance(m, nn.Linear))
    ids = torch.randint(5, copy.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, copy(ids).logits)


def test_bf16_gemm_choice_follows_the_arm_then_a_rule_on_the_cpu(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64)).to(torch.bfloat16)
    panels_here, widen_here, flags = [True], [False], [set()]
    # What this CPU runs, simulated (the rule alone, any CPU); the arms are arguments.
    monkeypatch.setattr(cpu, "bf16_panels_available", lambda arms=cpu.DEFAULT: panels_here[0])
    monkeypatch.setattr(cpu, "widen_in_registers", lambda arms=cpu.DEFAULT: widen_here[0])
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: flags[0])
    for setting in ("fp32", "bf16", "panels"):
        assert cpu.bf16_gemm_mode(model, cpu.Arms(bf16_gemm=setting)) == (setting, f"the bf16_gemm={setting} arm")
    panels_here[0] = False
    got, why = cpu.bf16_gemm_mode(model, cpu.Arms(bf16_gemm="panels"))
    assert got == "bf16" and "does not run here" in why
    # (panels kernel, widening kernel, AMX) -> the mode, whatever any GEMM's speed
    for panels, widen, amx, want in ((True, True, False, "panels"), (False, True, False, "fp32"),
                                     (False, False, False, "bf16"), (True, True, True, "bf16")):
        panels_here[0], widen_here[0], flags[0] = panels, widen, {"amx_bf16"} if amx else set()
        if amx and not cpu.can_prepack(torch.bfloat16):
            continue        # oneDNN has no bf16 here: AMX cannot be asked for
        got, why = cpu.bf16_gemm_mode(model)
        assert got == want, (panels, widen, amx, got, why)
        assert got == cpu.bf16_gemm_mode(model)[0]     # the same answer every time: no timing
    assert cpu.bf16_gemm_mode(nn.Sequential(nn.Linear(4, 4)))[0] == "bf16"   # fp32 model: nothing to decide
    # nothing is packed: nothing widens
    got, why = cpu.bf16_gemm_mode(model, cpu.Arms(bf16_gemm="fp32", prepack=False))
    assert got == "bf16" and "prepack=0" in why


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_bf16_widening_packs_for_the_kernel_or_onednn(monkeypatch, onednn_bf16):
    # Without oneDNN's bf16 (an older CPU), the bf16 side is the plain layer's F.linear and
    # widening still packs the fp32 copies.
    if not cpu.can_prepack(torch.float32) or (onednn_bf16 and not cpu.can_prepack(torch.bfloat16)):
        pytest.skip("oneDNN cannot prepack on this CPU")
    real = cpu.can_prepack
    monkeypatch.setattr(cpu, "can_prepack", lambda dt: real(dt) and (onednn_bf16 or dt != torch.bfloat16))
    model = nn.Sequential(nn.Linear(32, 48)).to(torch.bfloat16)
    widened = _classes("panels" if cpu.panels_wanted() else "onednn")[1]
    assert prepack_linears(model, widen_bf16=True) == 1 and _kind(model[0]) == widened
    plain = nn.Sequential(nn.Linear(32, 48)).to(torch.bfloat16)
    assert prepack_linears(plain) == (1 if onednn_bf16 else 0)


def test_prepacking_drops_only_weights_nobody_else_holds(demo_model_factory):
    model = _load(demo_model_factory("llama"))
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    prepack_linears(model)
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.numel() == 0 and q.in_features > 0        # replaced by its packed copy
    if tied:    # the embedding still reads the shared weight
        head = model.get_output_embeddings()
        assert isinstance(head, CpuLinear) and head.weight.numel() == model.get_input_embeddings().weight.numel() > 0
    kept = _load(demo_model_factory("llama"))
    prepack_linears(kept, keep_weights=True)                  # LoRA reads the weights
    assert kept.model.layers[0].self_attn.q_proj.weight.shape == (q.out_features, q.in_features)


def test_prepacking_switch(demo_model_factory):
    model = _load(demo_model_factory("llama"))
    assert prepack_linears(model, arms=cpu.Arms(prepack=False)) == 0
    assert not any(_kind(m) == ONEDNN for m in model.modules())


def test_runner_pool_is_head_major_on_cpu_and_switchable(demo_model_factory):
    from handler.model.runner import ModelRunner
    from kernels.torch_paged import head_major

    path = demo_model_factory("llama")
    r = ModelRunner(path, kv_cache_tokens=64, block_size=4)
    k = r.kv_cache[0][0].data
    assert k.shape == (16, 4, r.kv.num_kv_heads, r.kv.head_dim)   # every reader's view
    assert head_major(k) and not k.is_contiguous()
    r2 = ModelRunner(path, kv_cache_tokens=64, block_size=4, arms=cpu.Arms(kv_layout="token"))
    assert r2.kv_cache[0][0].data.is_contiguous()


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
    none = (str(tmp_path / "none"),)
    # avx2 kernels forced on an AVX-512 CPU: torch's vector kernels held to the same width
    assert preload_env({}, none, "avx2", {"avx512f", "avx2"}) == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert preload_env({}, none, "avx2", {"avx2"}) is None                 # an AVX2 host: torch is there already
    assert preload_env({"ATEN_CPU_CAPABILITY": "default"}, none, "avx2", {"avx512f"}) is None   # the user's own
    assert preload_env({}, none, "auto", {"avx512f"}) is None
    assert preload_env({"LD_PRELOAD": str(lib)}, dirs, "avx2", {"avx512f"}) == {
        "LD_PRELOAD": str(lib), "ATEN_CPU_CAPABILITY": "avx2"}             # once: the exec'd one sees both set


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


def _runner(model_dir, dtype, packed: bool, impl: str = "auto", arms=cpu.DEFAULT):
    from handler.model.runner import ModelRunner
    r = ModelRunner(model_dir, dtype=dtype, device="cpu", block_size=4, kv_cache_tokens=256, max_running=8,
                    model_impl=impl, arms=arms.with_(prepack=packed))
    r.prepack_cpu()
    return r


def _step_logits(runner) -> list:
    """Two prefills, then a mixed step (two decode rows and a third prompt), then two decodes."""
    from handler.engine.request import SamplingParams
    from handler.model.runner import pack_step
    from handler.engine.types import StepItem
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(max_new_tokens=4)
    a, b, c = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 5, 7))
    steps = [[StepItem(1, a, 0, [0, 1, 2], True, p, a), StepItem(2, b, 0, [3, 4], True, p, b)],
             [StepItem(1, [17], 9, [0, 1, 2], True, p, a + [17]), StepItem(2, [23], 5, [3, 4], True, p, b + [23]),
              StepItem(3, c, 0, [5, 6], True, p, c)],
             [StepItem(1, [4], 10, [0, 1, 2], True, p, a + [17, 4]), StepItem(3, [9], 7, [5, 6], True, p, c + [9])]]
    return [runner.forward(pack_step(items, 4)[0]) for items in steps]


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_our_packed_model_equals_transformers_packed_model(demo_model_factory, family, gemm):
    # The same GEMM kernel on the same weights in both: our forward's logits are transformers'
    # (through the paged attention interface), bit for bit, on every step.
    arms = cpu.Arms(gemm=gemm)
    path = demo_model_factory(family)
    ours, theirs = _runner(path, "fp32", True, arms=arms), _runner(path, "fp32", True, "transformers", arms)
    assert ours.own and not theirs.own
    fp32_cls = _classes(gemm)[0]
    assert all(_kind(m) == fp32_cls for m in ours.model.modules() if isinstance(m, nn.Linear))
    for got, want in zip(_step_logits(ours), _step_logits(theirs)):
        assert want.shape[0] >= 2 and torch.equal(got, want)


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 0.05)])
def test_our_packed_model_keeps_the_unpacked_models_values(demo_model_factory, dtype, tol):
    path = demo_model_factory("llama")
    plain, packed = _runner(path, dtype, False), _runner(path, dtype, True)
    assert not any(type(m) is not nn.Linear for m in plain.model.modules() if isinstance(m, nn.Linear))
    for got, want in zip(_step_logits(packed), _step_logits(plain)):
        got, want = got.float(), want.float()
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("gemm", ["onednn", pytest.param("panels", marks=needs_panels)])
@pytest.mark.parametrize("dtype,setting,widened", [("bf16", "fp32", True), ("bf16", "bf16", False),
                                                   ("fp32", "fp32", False)])
def test_runner_packs_bf16_linears_as_the_gemm_choice_says(demo_model_factory, dtype, setting, widened, gemm):
    if not cpu.can_prepack(torch.bfloat16):
        pytest.skip("oneDNN cannot prepack bf16 on this CPU")
    r = _runner(demo_model_factory("llama"), dtype, True, arms=cpu.Arms(bf16_gemm=setting, gemm=gemm))
    fp32_cls, widened_cls = _classes(gemm)
    want = widened_cls if widened else ONEDNN if dtype == "bf16" else fp32_cls
    linears = [m for m in r.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(_kind(m) == want for m in linears)
    assert all(m.pack.widen is widened for m in linears if _kind(m) in (PANELS, BF16_PANELS))


def test_ab_arms_are_set_by_name_and_refuse_other_values(monkeypatch):
    # Benchmarks pass the arms to the runner (benchmarks/step_floor.py --arm); the environment never sets them.
    arms = cpu.Arms().with_(gemm="OneDNN", prepack="0", decode_stack=False, kv_layout="token")
    assert (arms.gemm, arms.prepack, arms.decode_stack, arms.kv_layout) == ("onednn", False, False, "token")
    assert cpu.Arms.parse(["gemm=onednn", "decode_stack=0"]) == cpu.Arms(gemm="onednn", decode_stack=False)
    with pytest.raises(ValueError, match="gemm='mkl': allowed panels, onednn"):
        arms.with_(gemm="mkl")
    with pytest.raises(ValueError, match="no A/B arm 'attention'"):
        arms.with_(attention="reference")
    with pytest.raises(ValueError, match="prepack='yes': allowed 0, 1"):
        arms.with_(prepack="yes")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        cpu.Arms.parse(["gemm"])
    monkeypatch.setenv("LMI_CPU_GEMM", "onednn")                # the old switch: read by nobody now
    assert cpu.Arms().gemm == "panels" and cpu.panels_wanted() is cpu_ext.gemm_available()
    assert cpu.panels_wanted(arms) is False
    # No module state: an arm is an argument, so two runners in one process can differ.
    assert not any(isinstance(v, cpu.Arms) and v != cpu.Arms() for v in vars(cpu).values())
