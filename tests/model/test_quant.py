"""option.quantize=int8 (handler/model/quant.py, kernels/cpu_gemm_i8.c): the kernel's arithmetic against a
float64 reference on every kernel build this CPU runs, the avx2 build's bytes and values against the
avx512 build's, the layers it swaps, SmoothQuant keeping the float model's values, batch independence
under every strategy, and the quality on the real model."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from handler.engine.request import SamplingParams
from handler.model import quant
from handler.model.linear import CpuLinear
from handler.model.runner import ModelRunner
from kernels import cpu as cpu_ext, isa
from kernels.cpu import build as cpu_build
from tests.support.kernels import each_build_fixture, both_x86
from tests.support.engine import NEW, PROMPTS, STRATEGIES, make_engine, run_all

needs_vnni = pytest.mark.skipif(not cpu_ext.gemm_i8_available(),
                                reason="kernels/cpu_gemm_i8.c does not run here (no avx512/avx2/neon kernel build "
                                       "for this CPU, or no C compiler)")


each_build = each_build_fixture("gemm_i8_available", "int8 GEMM")


def _case(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    x[:, 3] *= 20           # an outlier channel, as LLM activations have
    b = torch.randn(n, generator=g)
    return x, w, b


def _exact(x, qw, sw, b):
    """float64 of the kernel's definition: per-row int8 activations x per-channel int8 weights."""
    qa, sa = quant.quantize_rows(x)
    return (qa.double() @ qw.double().T) * sa.double()[:, None] * sw.double()[None] + b.double()


@pytest.mark.parametrize("m,k,n", [(1, 576, 192), (7, 64, 33), (13, 1536, 576), (64, 130, 96), (200, 576, 1536)])
def test_int8_kernel_is_the_exact_integer_product_rescaled(each_build, m, k, n):
    x, w, b = _case(m, k, n)
    qw, sw = quant.quantize_rows(w)
    panels, wsum = cpu_ext.pack_i8(qw)
    got = cpu_ext.gemm_i8(x, panels, wsum, sw, n, b).double()
    want = _exact(x, qw, sw, b)
    # integer sums are exact; only the fp32 rescale rounds
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6
    # and the reference path computes the same thing
    ref = quant.int8_reference(x, qw, sw, b).double()
    assert ((ref - want).abs().max() / want.abs().max()).item() < 1e-6


def _quant_and_gemm(x, qw, sw, n, bias):
    """The selected build's lmi_quant_rows (bytes, scales) and its GEMM's output on x."""
    fn = cpu_ext.load()
    m, k = x.shape
    kp = -(-k // 4) * 4
    aq, sa = torch.empty(m, kp, dtype=torch.uint8), torch.empty(m)
    fn.quant_rows(x.data_ptr(), m, k, k, aq.data_ptr(), kp, sa.data_ptr(), torch.get_num_threads())
    panels, wsum = cpu_ext.pack_i8(qw)
    return aq, sa, cpu_ext.gemm_i8(x, panels, wsum, sw, n, bias)


@pytest.mark.parametrize("k", [4096, 2048])
def test_int8_rows_at_a_4k_stride_equal_each_row_alone(each_build, k):
    # K 4096: the activation bytes' rows are 4 KiB apart, read from kernels/cpu_panel.h's padded copy
    # past 8 rows; K 2048: the widened builds' int16 rows would be (their buffer's rows a line further
    # apart). Each row still equals itself alone (one row: no copy, no widening), in one chunk or
    # several (300 rows), and the integer product rescaled.
    g = torch.Generator().manual_seed(k)
    n = 70
    x, w, b = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    qw, sw = quant.quantize_rows(w)
    panels, wsum = cpu_ext.pack_i8(qw)
    alone = torch.cat([cpu_ext.gemm_i8(x[i:i + 1], panels, wsum, sw, n, b) for i in range(300)])
    for m in (8, 13, 40, 300):
        assert torch.equal(cpu_ext.gemm_i8(x[:m], panels, wsum, sw, n, b), alone[:m]), m
    aq, sa, _ = _quant_and_gemm(x, qw, sw, n, b)       # the kernel's own bytes: its integer sums are exact
    want = ((aq.double()[:, :k] - 128) @ qw.double().T) * sa.double()[:, None] * sw.double()[None] + b.double()
    assert ((alone.double() - want).abs().max() / want.abs().max()).item() < 1e-6


def test_int8_kernel_sums_every_int8_weight_exactly(each_build):
    # Weights of any int8 value (-128 too, which quantize_rows never makes) and activations at both
    # ends of -127..127: AVX2's vpmaddubsw pair sums (|W| x signed q) must not saturate; the integer
    # sum is then exact, and the rescale rounds once per step as the definition says.
    g = torch.Generator().manual_seed(3)
    m, k, n = 9, 203, 70
    qw = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    qw[:, :8] = -128
    x = torch.randn(m, k, generator=g)
    x[:, :8] = x[:, :1].abs() * 1e3 * torch.tensor([1, -1, 1, -1, 1, -1, 1, -1])  # q = +-127 in those columns
    sw = torch.rand(n, generator=g) * 1e-2
    aq, sa, got = _quant_and_gemm(x, qw, sw, n, None)
    q = aq[:, :k].int() - 128
    assert q[:, :8].abs().eq(127).all()
    acc = (q.double() @ qw.double().T)                       # exact in float64
    want = (acc.float() * sw[None]) * sa[:, None]            # fp32: one rounding each, as the kernel's fma(., ., 0)
    assert torch.equal(got, want)


@both_x86
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_int8_is_the_avx512_builds_bytes_and_values(bias):
    # Row quantization (bytes and scales) and the GEMM's fp32 outputs through the avx2 build equal the
    # avx512 build's (VNNI vpdpbusd there) on the same inputs: m across row-block sizes of both builds,
    # k not a multiple of 4 or of 16, n not a multiple of 32, rows of zeros, exact .5 ties, a row
    # whose scale is tiny (127 / max overflows to inf) and one with a NaN.
    g = torch.Generator().manual_seed(4)
    try:
        for m, k, n in [(1, 576, 1536), (2, 7, 33), (3, 130, 96), (5, 33, 1), (13, 1537, 576), (14, 18, 40),
                        (15, 99, 70), (50, 896, 97), (127, 16, 32), (300, 61, 65)]:
            x = torch.randn(m, k, generator=g)
            x[:, min(3, k - 1)] *= 20
            if m >= 5:
                x[1] = 0
                x[2, :] = torch.arange(k) % 5 - 2.0
                x[2, 0] = 2 * 127 / 63           # inv = 63 / 2: every odd code lands on .5 (ties to even)
                x[3] *= 1e-39
                x[4, k // 2] = float("nan")
            qw, sw = quant.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
            b = torch.randn(n, generator=g) if bias else None
            got = {}
            for build in ("avx512", "avx2"):
                cpu_ext.select(build)
                assert cpu_ext.gemm_i8_available(), build
                got[build] = _quant_and_gemm(x, qw, sw, n, b)
            for name, a, c in zip(("bytes", "scales", "outputs"), got["avx512"], got["avx2"]):
                assert torch.equal(a, c) or (name == "outputs" and torch.equal(a.isnan(), c.isnan())
                                             and torch.equal(a.nan_to_num(), c.nan_to_num())), (m, k, n, name)
    finally:
        cpu_ext.select(None)


@pytest.mark.skipif(not {"avx512", "avx2"} <= set(isa.host_isas()) or not {"avx512_vnni", "avx512vl"} <= isa.cpu_flags()
                    or cpu_build.compiler() is None,
                    reason="runs the avx2 build's AVX-VNNI int8 path through its EVEX twin: needs AVX512-VNNI/VL, "
                           "the avx512 build to compare with, and a C compiler")
def test_avx_vnni_int8_path_is_the_avx512_builds_values(tmp_path):
    # An avx2 build on a CPU with AVX-VNNI (-mavxvnni) sums with vpdpbusd on ymm and takes the +128 back
    # by wsum. This CPU may lack AVX-VNNI, so the same code is built with the instruction's EVEX form
    # (LMI_I8_CHECK_EVEX_VNNI: the same operation) and compared with the avx512 build.
    import ctypes
    import subprocess
    so = str(tmp_path / "i8_vnni.so")
    srcs = [os.path.join(cpu_build.SRC_DIR, f) for f in ("cpu_gemm_i8.c", os.path.join("x86", "gemm_i8.c"))]
    r = subprocess.run([cpu_build.compiler(), *cpu_build.EXACT_FLAGS, "-march=x86-64-v3", "-mtune=generic",
                        "-DLMI_I8_CHECK_EVEX_VNNI", "-shared", *srcs, "-o", so, "-lm"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    lib = ctypes.CDLL(so)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lmi_pack_i8.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.lmi_gemm_i8.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, ctypes.c_int]
    g = torch.Generator().manual_seed(6)
    try:
        cpu_ext.select("avx512")
        for m, k, n in [(1, 576, 1536), (3, 130, 96), (4, 33, 1), (50, 896, 97), (300, 61, 65)]:
            x = torch.randn(m, k, generator=g)
            qw = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
            sw, b = torch.rand(n, generator=g) * 1e-2, torch.randn(n, generator=g)
            aq, sa, want = _quant_and_gemm(x, qw, sw, n, b)
            kp = aq.shape[1]
            panels = torch.empty(-(-n // 32) * 32 * kp, dtype=torch.int8)
            wsum = torch.empty(n, dtype=torch.int32)
            lib.lmi_pack_i8(qw.data_ptr(), n, k, panels.data_ptr(), wsum.data_ptr())
            got = torch.empty(m, n)
            lib.lmi_gemm_i8(aq.data_ptr(), m, kp, sa.data_ptr(), panels.data_ptr(), wsum.data_ptr(), sw.data_ptr(), n,
                            b.data_ptr(), got.data_ptr(), n, torch.get_num_threads())
            assert torch.equal(got, want), (m, k, n)
    finally:
        cpu_ext.select(None)


@pytest.mark.parametrize("m,k,n", [(5, 256, 64), (32, 576, 192)])
def test_int8_error_against_the_float64_product_is_bounded(m, k, n):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g)
    qw, sw = quant.quantize_rows(w)

    def rel(x):
        got = quant.int8_reference(x, qw, sw, b).double()
        full = x.double() @ w.double().T + b.double()
        deq = x.double() @ (qw.double() * sw.double()[:, None]).T + b.double()
        return ((got - full).norm() / full.norm()).item(), ((deq - full).norm() / full.norm()).item()

    both, weights = rel(x)
    assert both < 0.012 and weights < 0.008, (both, weights)     # 8-bit rows and channels: under 1%
    x[:, 3] *= 20       # one outlier channel: the row's scale grows 20x, every other entry loses bits
    both_out, weights_out = rel(x)
    assert weights_out < 0.008 and 0.02 < both_out < 0.04, (both_out, weights_out)   # what smoothing is for


def test_quantize_rows_rounds_each_row_by_its_own_scale():
    w = torch.tensor([[0.0, 0.0], [1.0, -0.5], [127.0, 63.4]])
    q, s = quant.quantize_rows(w)
    assert q.dtype == torch.int8 and s.tolist() == pytest.approx([0.0, 1 / 127, 1.0])
    assert q.tolist() == [[0, 0], [127, -64], [127, 63]]     # -63.5 rounds to even


def _runner(model_dir, quantize=None, dtype="fp32", fuse=True):
    return ModelRunner(model_dir, dtype=dtype, device="cpu", kv_cache_tokens=512, block_size=16,
                       quantize=quantize, fuse=fuse)


def test_quantized_model_swaps_every_linear_but_the_head(demo_model_dir):
    r = _runner(demo_model_dir, "int8", fuse=False)    # the checkpoint's layer names, as LoRA sees them
    linears = [m for m in r.model.modules() if isinstance(m, nn.Linear)]
    head = r.model.get_output_embeddings()
    assert type(head) is nn.Linear and head.weight.numel() > 0
    body = [m for m in linears if m is not head]
    assert body and all(isinstance(m, CpuLinear) and isinstance(m.pack, quant.Int8Pack) for m in body)
    assert all(m.weight.numel() == 0 for m in body)           # the float copy is gone
    layer = r.model.model.layers[0]    # smoothed: those after a norm or up_proj; o_proj is not
    for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert getattr(layer.get_submodule(name), "input_scale", None) is not None, name
    assert getattr(layer.self_attn.o_proj, "input_scale", None) is None


def test_smoothing_keeps_the_float_models_values(demo_model_dir):
    from tests.model.test_llama import _step_logits
    plain = _runner(demo_model_dir)
    smoothed = _runner(demo_model_dir, fuse=False)     # smoothing runs before fusing
    called = []

    def calibrate():
        called.append(1)
        _step_logits(smoothed)
    n = quant.smooth(smoothed.model, calibrate)
    assert n == 3 * smoothed.model.arch.layers and called
    scales = [m.input_scale for m in smoothed.model.modules() if getattr(m, "input_scale", None) is not None]
    assert scales and any((s - 1).abs().max() > 0.1 for s in scales)   # it did move something
    for got, want in zip(_step_logits(smoothed), _step_logits(plain)):
        assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("quantize", [None, pytest.param("int8", marks=needs_vnni)])
def test_fused_projections_change_no_value(demo_model_factory, quantize):
    # q/k/v and gate/up as one GEMM each (one rounding of the shared input when int8): the
    # per-column kernels give every logit of every step bit for bit as the separate layers do.
    from tests.model.test_cpu import _step_logits
    if not cpu_ext.gemm_available():
        pytest.skip("kernels/cpu_gemm.c (the fp32 panels fusing is for) needs AVX-512F")
    path = demo_model_factory("qwen2")      # q/k/v biases; intermediate size not a multiple of 32
    fused, apart = _runner(path, quantize), _runner(path, quantize, fuse=False)
    for r in (fused, apart):
        r.prepack_cpu()
    layer = fused.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    assert apart.model.model.layers[0].self_attn.qkv_proj is None
    for got, want in zip(_step_logits(fused), _step_logits(apart)):
        assert torch.equal(got, want)


@needs_vnni
def test_int8_row_results_do_not_depend_on_the_batch(demo_model_dir):
    # Each row is rounded by its own scale: a sequence's decode logits are the same alone or
    # beside another sequence (per-tensor activation scales would mix the rows). The fp32 head
    # packed for kernels/cpu_gemm.c, whose rows are independent too, as the server runs it.
    from handler.model.runner import pack_step
    from handler.engine.types import StepItem
    if not cpu_ext.gemm_available():
        pytest.skip("kernels/cpu_gemm.c (row-independent fp32 head) needs AVX-512F")
    r = _runner(demo_model_dir, "int8")
    r.prepack_cpu()
    p = SamplingParams(max_new_tokens=4)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(5, 900, (n,), generator=g).tolist() for n in (21, 9))
    for items in ([StepItem(0, a, 0, [0, 1], True, p, a)], [StepItem(1, b, 0, [2], True, p, b)]):
        r.forward(pack_step(items, 16)[0])
    da = StepItem(0, [7], 21, [0, 1], True, p, a + [7])
    db = StepItem(1, [900], 9, [2], True, p, b + [900])
    alone = r.forward(pack_step([da], 16)[0])
    beside = r.forward(pack_step([db, da], 16)[0])
    assert torch.equal(beside[1], alone[0])


def test_int8_serves_under_every_strategy(demo_model_dir, tmp_path):
    for name, props in STRATEGIES.items():
        engine = make_engine(demo_model_dir, tmp_path, {**props, "option.quantize": "int8"})
        try:
            assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj.pack, quant.Int8Pack)
            results = run_all(engine, PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW])
            assert [len(ids) for ids, _ in results] == NEW, name
        finally:
            engine.shutdown()


def test_int8_with_a_lora_adapter_matches_the_adapter_on_the_smoothed_layer(demo_model_dir, tmp_path):
    # The adapter's A is multiplied by the layer's smoothing scale, so x/s @ (A s)^T == x @ A^T.
    from handler.model.lora import LoRALinear
    r = _runner(demo_model_dir, "int8", fuse=False)     # LoRA wraps the checkpoint's layers
    q = r.model.model.layers[0].self_attn.q_proj
    s = q.input_scale
    wrapped = LoRALinear(q, slots=1, max_rank=4)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, q.in_features, generator=g), torch.randn(q.out_features, 2, generator=g)
    wrapped.load(0, (a, b))
    assert torch.allclose(wrapped.lora_a[0, :2], a * s)


def test_int8_quality_on_the_real_model(real_model_dir):
    """Perplexity of the held-aside texts within 3% of fp32's; teacher-forced greedy agreement on
    the chat prompts at least 80% (handler/tools/quality.py measures both). Measured ratios (english / python):
    1.012 / 1.013 on an AVX-512 Zen 4 host (benchmarks/results/quality-smollm2-135m), 1.013 / 1.028 on an
    AVX2-only Zen 3 host (why the python text moves there: open)."""
    from handler.tools import quality
    base = quality.measure(real_model_dir, "fp32", None, 32)
    cand = quality.measure(real_model_dir, "fp32", "int8", 32, reference=base["answers"])
    for name in quality.TEXTS:
        assert cand["perplexity"][name] <= 1.03 * base["perplexity"][name], (name, cand["perplexity"], base["perplexity"])
    same, total = cand["teacher_forced"]
    assert total > 100 and same / total >= 0.8, (same, total)
    assert cand["weight_bytes"] < 0.6 * base["weight_bytes"]
