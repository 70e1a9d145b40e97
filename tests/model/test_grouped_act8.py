"""Grouped weights times int8 activations (LMI_CPU_Q_ACT8=1, kernels/cpu_gemm_q4.c's HAVE_Q_A8): the
kernel against the definition written out here in numpy (each row quantized per group, integer sums,
then s * (sum * da) + m * (da * sum aq)), for 4- and 8-bit codes and every scale form; a row's result
does not depend on the rows beside it; what it does not serve (5/6-bit codes, W8A16's one group a
row) stays exact; and the switch off gives the exact results back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from handler.model.quant_int4 import Grouped, pack
from kernels import cpu_ext

pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
from tests.model.test_grouped_layouts import _gguf  # noqa: E402


@pytest.fixture
def act8():
    if not cpu_ext.gemm_q_available() or not cpu_ext.set_q_act8(True):
        cpu_ext.set_q_act8(False)
        pytest.skip("the int8-activation path needs the avx512 build with VNNI and VBMI (AMD Zen 4, Intel Ice "
                    "Lake or later); this CPU's build has no such path")
    try:
        yield
    finally:
        cpu_ext.set_q_act8(False)


def _reference(x: torch.Tensor, w: Grouped) -> np.ndarray:
    """The int8-activation product as defined in kernels/cpu_gemm_q4.c, float64 past the int32 sums."""
    g = w.group
    q = w.q.numpy().astype(np.int64)
    s, m = w.scales.numpy().astype(np.float64), w.mins.numpy().astype(np.float64)
    out = np.zeros((x.shape[0], q.shape[0]))
    for r, row in enumerate(x.numpy().astype(np.float32)):
        for gi in range(q.shape[1] // g):
            a = row[gi * g:(gi + 1) * g]
            amax = np.float32(np.abs(a).max())
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            aq = np.rint(a * inv).astype(np.int64)                   # fp32 product, rounded half to even
            da = np.float32(amax / np.float32(127))
            sa = np.float32(da * np.float32(aq.sum()))
            out[r] += s[:, gi] * (q[:, gi * g:(gi + 1) * g] @ aq * np.float64(da)) + m[:, gi] * np.float64(sa)
    return out


@pytest.mark.parametrize("kind,n,k", [("Q4_K", 70, 512), ("Q6_K", 64, 512), ("Q5_0", 40, 256), ("Q8_0", 33, 256),
                                      ("Q4_0", 100, 1024), ("Q5_K", 32, 256), ("Q4_1", 45, 96)])
def test_kernel_is_the_int8_activation_product_it_defines(act8, kind, n, k):
    w = _gguf(kind, n, k)
    p = pack(w)
    assert p.bits in (4, 8)
    gen = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=gen)
    for m in (1, 2, 7, 13):                     # row blocks of 6 and their remainders
        x = torch.randn(m, k, generator=gen)
        for bias in (None, b):
            got = cpu_ext.gemm_q(x, p, n, bias).double().numpy()
            want = _reference(x, w) + (0 if bias is None else b.double().numpy())
            # fp32 rounding of a few operations per group: far below one activation step
            scale = np.abs(x.double().numpy()) @ np.abs(w.dequantize().double().numpy().T) + 1e-30
            assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), (kind, m, np.max(np.abs(got - want) / scale))
            # and it is the product with rounded activations, not the exact one (nor far from it)
            exact = (x.double() @ w.dequantize().double().T).numpy() + (0 if bias is None else b.double().numpy())
            err = np.abs(got - exact) / scale
            assert err.max() < 0.02 and err.max() > 1e-7, (kind, m, err.max())


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(act8):
    w = _gguf("Q4_K", 96, 512)
    p = pack(w)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    together = cpu_ext.gemm_q(x, p, 96, None)
    for r in range(9):
        assert torch.equal(cpu_ext.gemm_q(x[r:r + 1], p, 96, None)[0], together[r])


def test_what_it_does_not_serve_stays_exact(act8, monkeypatch):
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    packed6 = _gguf("Q6_K", 64, 512)
    monkeypatch.setenv("LMI_QUANT_PACKED_CODES", "1")
    cases = [(packed6, pack(packed6))]                                # 6-bit packed codes
    q = torch.randint(0, 256, (40, 512), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    s = torch.rand(40, 1, generator=torch.Generator().manual_seed(2)) * 0.01
    w8 = Grouped(q, s, -128 * s, 8, 512)                               # W8A16: one group of 512 a row
    cases.append((w8, pack(w8)))
    for w, p in cases:
        want = cpu_ext.gemm(x, cpu_ext.pack_panels(w.dequantize()), w.shape[0], None)
        assert torch.equal(cpu_ext.gemm_q(x, p, w.shape[0], None), want), p.bits


def test_switched_off_the_exact_results_come_back(act8):
    w = _gguf("Q4_K", 64, 512)
    p = pack(w)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    want = cpu_ext.gemm(x, cpu_ext.pack_panels(w.dequantize()), 64, None)
    assert not torch.equal(cpu_ext.gemm_q(x, p, 64, None), want)
    cpu_ext.set_q_act8(False)
    assert torch.equal(cpu_ext.gemm_q(x, p, 64, None), want)


def test_the_switch_reads_0_or_1():
    assert cpu_ext.q_act8_wanted({}) is False
    assert cpu_ext.q_act8_wanted({"LMI_CPU_Q_ACT8": " 1 "}) is True
    assert cpu_ext.q_act8_wanted({"LMI_CPU_Q_ACT8": "yes"}) is False     # warned, the default kept
