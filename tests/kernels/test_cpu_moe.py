"""A mixture-of-experts MLP's experts in one C call (kernels/cpu_layer.c lmi_moe_experts, bound by
handler/model/moe.py SparseMoe.bind_kernel over the packs handler/model/cpu.py, quant.py and
quant_int4.py make): for every weight format our packs hold (fp32 panels, bf16 panels by vdpbf16ps
or widened, int8 W8A8, W8A16, GGUF's grouped 4/5/6/8-bit blocks) and fp32 / bf16 activations, a
step's rows (decode and prompt rows together, some experts idle, one expert taking most rows) come
out as the Python loop over experts (torch's per-expert GEMMs, index_put_ accumulation) bit for
bit, and as a float64 oracle of the formula within rounding.

The tests run on the build this process picks; the last test reruns them in a subprocess for every
other build this CPU runs (the forced AVX2 build beside torch's AVX2 vectors, as
tests/model/test_cpu_stack.py does). The NEON build's expert call is checked under qemu by
tests/kernels/arm/check_kernels.c ("moe")."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from handler.model import layers, moe
from handler.model.cpu import Arms, prepack_linears
from kernels import cpu as cpu_ext, isa
from tests.model.test_cpu_stack import _WHY, BUILD, passed_on_build

needs_kernel = pytest.mark.skipif(bool(_WHY), reason=_WHY or "ok")

# (name, activations, how the experts are packed); the bf16 dot-product GEMM needs AVX512-BF16
FORMATS = ["fp32", "bf16-dot", "bf16-widened", "int8", "w8a16", "gguf-Q4_K", "gguf-Q5_K", "gguf-Q6_K", "gguf-Q8_0",
           "gguf-Q4_0"]


def _spec(experts=8, top_k=3, width=96, mixtral=False) -> moe.MoeSpec:
    return moe.MoeSpec(experts=experts, top_k=top_k, intermediate=width, norm_topk=True, fp32_weights=mixtral,
                       shared=0, sparse=(True,))


def _block(fmt: str, dtype: torch.dtype, hidden: int = 64, spec: moe.MoeSpec | None = None, seed: int = 0):
    """A SparseMoe of random weights packed in `fmt`, its C call bound (asserted)."""
    if fmt.startswith("gguf"):      # K-quants: 256 inputs a superblock
        hidden, spec = 256, spec or _spec(width=256)
    spec = spec or _spec()
    torch.manual_seed(seed)
    m = moe.SparseMoe(hidden, spec, layers.TensorParallel(), dtype, "cpu")
    for p in m.parameters():
        p.data.normal_(0, 0.15)
    if fmt.startswith("gguf"):      # a loader's blocks: gate and up stay apart
        _gguf_experts(m, fmt.removeprefix("gguf-"))
    else:
        m.fuse()
        if fmt in ("int8", "w8a16"):
            from handler.model import quant
            quant.quantize_model(m, "int8" if fmt == "int8" else "int8_weight_only")
        else:
            prepack_linears(m, widen_bf16=fmt == "bf16-widened", bf16_panels=fmt == "bf16-dot")
    why = m.bind_kernel()
    assert why is None, why
    return m


def _gguf_experts(m: moe.SparseMoe, kind: str) -> None:
    gguf = pytest.importorskip("gguf", reason="the gguf package makes the blocks: pip install -e '.[gguf]'")
    from handler.model import quant_formats as qf
    from handler.model.quant_int4 import grouped_linear
    from tests.model.test_gguf_blocks import _raw
    rng = np.random.default_rng(7)
    assert gguf is not None
    for ex in m.experts:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(ex, name)
            n, k = lin.weight.shape
            raw = _raw(kind, lin.weight.float().numpy(), rng)
            setattr(ex, name, grouped_linear(lin, qf.gguf_blocks(kind, raw, n, k), f"gguf {kind}", True))


def _rows(m: moe.SparseMoe, t: int, dtype, seed: int = 1, crowd: bool = False):
    """x [t, E] and its routing; `crowd`: most rows sent to expert 2 (one expert's GEMM over many rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, m.gate.in_features, generator=g).to(dtype)
    weights, ids = m.route(x)
    if crowd:
        ids = ids.clone()
        ids[:, 0] = torch.where(ids[:, 1:].eq(2).any(1), ids[:, 0], 2)
    return x, weights, ids


def _python(m, x, weights, ids):
    bound, m.cpu_experts = m.cpu_experts, None
    try:
        return m.experts_forward(x, weights, ids)
    finally:
        m.cpu_experts = bound


def _oracle(m, x, weights, ids) -> torch.Tensor:
    """float64: sum_j w_j down(silu(gate x) * up x), the experts' weights as each pack holds them (the
    unpacked fp32 / bf16 weights; for the quantized formats, their own dequantized product on an
    identity batch)."""
    def dense(lin):
        eye = torch.eye(lin.in_features, dtype=torch.float32)
        return lin(eye.to(x.dtype)).double().t()      # W [N, K] as the pack multiplies (exact for a one-hot row)

    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = m.experts[int(ids[t, j])]
            if ex.gate_up_proj is not None:
                gate, up = dense(ex.gate_up_proj).chunk(2, 0)
            else:
                gate, up = dense(ex.gate_proj), dense(ex.up_proj)
            g, u = gate @ xd[t], up @ xd[t]
            out[t] += float(weights[t, j]) * (dense(ex.down_proj) @ (torch.nn.functional.silu(g) * u))
    return out


def _available(fmt: str) -> str:
    if fmt == "bf16-dot" and not cpu_ext.gemm_bf16_available():
        return f"no bf16 dot-product GEMM in the {BUILD} build (AVX512-BF16)"
    if fmt == "bf16-widened" and not cpu_ext.gemm_bf16w_available():
        return f"no widened bf16 GEMM in the {BUILD} build"
    if fmt == "int8" and not cpu_ext.gemm_i8_available():
        return f"no int8 GEMM in the {BUILD} build"
    if fmt in ("w8a16",) or fmt.startswith("gguf"):
        if not cpu_ext.gemm_q_available():
            return f"no grouped-weight GEMM in the {BUILD} build"
    return ""


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_in_one_call_equal_the_python_loop_bit_for_bit(fmt):
    if _available(fmt):
        pytest.skip(_available(fmt))
    dtype = torch.bfloat16 if fmt.startswith("bf16") else torch.float32
    m = _block(fmt, dtype)
    # 1 row: 3 experts, one after another (each GEMM over the threads); more: experts in parallel
    for t, crowd in ((1, False), (5, False), (37, True), (300, True)):
        x, weights, ids = _rows(m, t, dtype, seed=t, crowd=crowd)
        got = cpu_ext.moe_experts(x, ids, weights, *m.cpu_experts[:3])
        want = _python(m, x, weights, ids)
        assert got.dtype == dtype and torch.equal(got, want), (fmt, t, (got.float() - want.float()).abs().max())
        assert torch.equal(m.experts_forward(x, weights, ids), got)    # the module's path is the C call
    # and the formula: within the rounding of each format's products and sums
    x, weights, ids = _rows(m, 6, dtype, seed=3)
    ref = _oracle(m, x, weights, ids)
    err = ((m.experts_forward(x, weights, ids).double() - ref).abs().max() / ref.abs().max()).item()
    tol = {"fp32": 1e-5, "int8": 0.05, "bf16-dot": 0.03, "bf16-widened": 0.03}.get(fmt, 2e-3 if dtype == torch.float32
                                                                                    else 0.03)
    assert err < tol, (fmt, err)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixtral_fp32_routing_weights_round_as_the_python_loop(dtype):
    # Mixtral keeps its top-k weights in fp32 beside bf16 activations: the product is formed in fp32
    # and rounded once, as torch's promotion does in the loop
    fmt = "fp32" if dtype == torch.float32 else ("bf16-dot" if cpu_ext.gemm_bf16_available() else "bf16-widened")
    if _available(fmt):
        pytest.skip(_available(fmt))
    m = _block(fmt, dtype, spec=_spec(experts=4, top_k=2, mixtral=True))
    x, weights, ids = _rows(m, 9, dtype)
    assert weights.dtype == torch.float32
    assert torch.equal(m.experts_forward(x, weights, ids), _python(m, x, weights, ids))


@needs_kernel
def test_threads_do_not_change_the_answer():
    m = _block("fp32", torch.float32)
    x, weights, ids = _rows(m, 400, torch.float32, crowd=True)    # past torch's grain: split across threads
    old = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_ext.moe_experts(x, ids, weights, *m.cpu_experts[:3]))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_kernel
def test_an_expert_id_outside_the_block_is_refused_before_anything_is_written():
    m = _block("fp32", torch.float32)
    x, weights, ids = _rows(m, 3, torch.float32)
    bad = ids.clone()
    bad[1, 1] = m.spec.experts
    with pytest.raises(IndexError, match=r"outside \[0, 8\)"):
        cpu_ext.moe_experts(x, bad, weights, *m.cpu_experts[:3])
    empty = cpu_ext.moe_experts(x[:0], ids[:0], weights[:0], *m.cpu_experts[:3])
    assert empty.shape == (0, x.shape[1])


@needs_kernel
def test_experts_the_c_call_cannot_take_stay_in_python_and_say_why():
    # plain nn.Linear experts (nothing packed): the loop serves, and bind_kernel names the expert
    m = moe.SparseMoe(64, _spec(), layers.TensorParallel(), torch.float32, "cpu")
    m.fuse()
    assert m.bind_kernel() == "expert 0: a Linear with torch.float32 activations"
    assert m.cpu_experts is None
    x, weights, ids = _rows(m, 4, torch.float32)
    assert torch.equal(m.experts_forward(x, weights, ids), _python(m, x, weights, ids))


@needs_kernel
def test_the_runner_binds_the_experts_and_the_arm_turns_it_off(caplog, demo_model_dir, tmp_path):
    from handler.model.runner import ModelRunner
    from tests.model.test_moe import build
    d = build("qwen3_moe", str(tmp_path / "m"), demo_model_dir)
    logs = {}
    for on in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmi"):
            r = ModelRunner(d, dtype="fp32", device="cpu", kv_cache_tokens=64, arms=Arms(moe_kernel=on))
            r.prepack_cpu()
        sparse = [m for m in r.model.modules() if isinstance(m, moe.SparseMoe)]
        assert sparse and all((m.cpu_experts is not None) == on for m in sparse)
        logs[on] = [rec.getMessage() for rec in caplog.records if "mixture-of-experts layers:" in rec.getMessage()]
    assert logs[True] == ["CPU: mixture-of-experts layers: each step's rows through the experts in one C call a "
                          "layer (kernels/cpu_layer.c lmi_moe_experts)"]
    assert len(logs[False]) == 1 and "moe_kernel=0 arm" in logs[False][0]


@pytest.mark.parametrize("build", [b for b in isa.host_isas() if b != BUILD] or [None])
def test_experts_on_every_other_build_this_cpu_runs(build):
    if build is None:
        pytest.skip(f"this CPU runs no build but {BUILD} (of {', '.join(isa.ISAS)}), tested above")
    passed, out = passed_on_build(build, __file__, "bit_for_bit or round_as or threads")
    for want in ("test_experts_in_one_call_equal_the_python_loop_bit_for_bit[fp32]",
                 "test_experts_in_one_call_equal_the_python_loop_bit_for_bit[gguf-Q4_K]",
                 "test_experts_in_one_call_equal_the_python_loop_bit_for_bit[int8]",
                 "test_mixtral_fp32_routing_weights_round_as_the_python_loop[dtype1]"):
        assert want in passed, f"{want} did not pass on the {build} build:\n{out[-4000:]}"
