"""Grouped weights times int8 activations (a QPack's act8: option.cpu_grouped_activations=int8,
kernels/cpu_gemm_q4.c's HAVE_Q_A8), on each
kernel build this CPU runs that has the path (avx512 with VNNI and VBMI; avx2): the kernel against the
definition written out here in numpy (each row quantized per group, integer sums, then
s * (sum * da) + m * (da * sum aq)), for 4-, 5-, 6- and 8-bit codes (5/6-bit as bytes and packed,
option.grouped_code_layout) and every scale form; the same values whatever width the codes are streamed at;
the avx2 build equals the avx512 build bit for bit; a row's result does not depend on the rows beside it;
what it does not serve (groups that are not whole 4-input steps, W8A16's one group a row) stays exact; and
a pack without act8 gives the exact results back, on the same library (the choice is the pack's, per call,
not the process's)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from handler.model.quant_int4 import Grouped, pack
from kernels import cpu as cpu_ext
from tests.support.kernels import both_x86, each_build_fixture

pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
from tests.model.test_grouped_layouts import _gguf  # noqa: E402

each_build = each_build_fixture("gemm_q_available", "grouped-weight kernel")


@pytest.fixture
def act8(each_build):
    if not cpu_ext.q_act8_available():
        pytest.skip(f"the {each_build} build has no int8-activation path (the avx512 build on a CPU with VNNI and "
                    f"VBMI, such as AMD Zen 4 or Intel Ice Lake and later; the avx2 build)")
    return each_build


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


# (kind, N, K, the code width packed): partial last panels; Q6_K's groups of 16 in two-level int8 scales (QS_I8),
# Q5_K's of 32 (QS_I8), Q5_0 / Q5_1 / Q4_x / Q8_0's fp16 ones (QS_F16)
GGUF_CASES = [("Q4_K", 70, 512, 4), ("Q6_K", 64, 512, 6), ("Q6_K", 70, 512, 6), ("Q5_0", 40, 256, 5),
              ("Q5_1", 33, 96, 5), ("Q8_0", 33, 256, 8), ("Q4_0", 100, 1024, 4), ("Q5_K", 32, 256, 5),
              ("Q5_K", 45, 512, 5), ("Q4_1", 45, 96, 4)]


@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "packed"])
@pytest.mark.parametrize("kind,n,k,need", GGUF_CASES)
def test_kernel_is_the_int8_activation_product_it_defines(act8, kind, n, k, need, packed):
    w = _gguf(kind, n, k)
    p = pack(w, packed=packed, act8=True)
    assert p.bits == (need if packed or need == 4 else 8)
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


@pytest.mark.parametrize("bits,g,n,k", [(4, 20, 37, 100), (8, 12, 33, 96), (4, 4, 40, 64), (5, 20, 37, 100),
                                         (6, 12, 33, 96), (6, 4, 40, 64), (5, 256, 70, 512)])
def test_groups_that_are_not_whole_vectors(act8, bits, g, n, k):
    # AWQ/GPTQ-style groups that a vector does not divide (the quantized row's scalar tail), and the largest
    # served (256), codes at both ends, fp32 scales and mins (QS_F32); 5/6-bit codes packed at their width.
    gen = torch.Generator().manual_seed(g * 100 + n + bits)
    q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=gen)
    q[0], q[1] = 0, 2 ** bits - 1
    s = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-3
    m = -s * torch.randint(0, 2 ** bits, (n, k // g), generator=gen)
    w = Grouped(q, s, m, 4 if bits == 4 else 8, g)
    p = pack(w, bits=bits, act8=True)
    assert p.smode == cpu_ext.QS_F32
    x = torch.randn(5, k, generator=gen)
    x[2] = 0                                              # an all-zero row: scale 0, no division by it
    got = cpu_ext.gemm_q(x, p, n, None).double().numpy()
    want = _reference(x, w)
    scale = np.abs(x.double().numpy()) @ np.abs(w.dequantize().double().numpy().T) + 1e-30
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), np.max(np.abs(got - want) / scale)
    assert not got[2].any()


def test_every_code_width_gives_the_same_values(act8):
    # Integer sums of the same codes: Q6_K / Q5_K streamed as bytes or packed at 6 / 5 bits (and 5-bit codes
    # at 6 bits) give the same results bit for bit, on the register kernels' and the avx2 build's
    # transposed-panel row counts.
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))
    for kind, widths in (("Q6_K", (6, 8)), ("Q5_K", (5, 6, 8))):
        w = _gguf(kind, 70, 512)
        got = [cpu_ext.gemm_q(x[:m], pack(w, bits=b, act8=True), 70, None) for b in widths for m in (1, 3, 9)]
        for i in range(3, len(got)):
            assert torch.equal(got[i], got[i % 3]), (kind, i)


@both_x86
@pytest.mark.parametrize("kind,n,k,packed", [("Q4_K", 70, 512, False), ("Q6_K", 40, 512, False),
                                             ("Q8_0", 33, 256, False), ("Q4_1", 45, 96, False),
                                             ("Q6_K", 70, 512, True), ("Q5_K", 45, 512, True),
                                             ("Q5_0", 40, 256, True)])
def test_the_avx2_build_equals_the_avx512_build(kind, n, k, packed):
    # The same quantized rows and per-group fp32 operations in the same order: equal bit for bit, on row
    # counts that cover both builds' blocks (avx2: 2 rows, then 3-row blocks over a transposed panel;
    # avx512: 6) and ragged last panels. Q8_0's codes reach 255, the avx2 kernel's offset path; packed
    # 5/6-bit codes, each build's bit-plane transposition.
    w = _gguf(kind, n, k)
    p = pack(w, packed=packed, act8=True)
    if packed:
        assert p.bits == {"Q6_K": 6, "Q5_K": 5, "Q5_0": 5}[kind]
    gen = torch.Generator().manual_seed(k + n)
    xs = [torch.randn(m, k, generator=gen) for m in (1, 2, 3, 7, 13)]
    bias = torch.randn(n, generator=gen)
    got = {}
    try:
        for build in ("avx512", "avx2"):
            cpu_ext.select(build)
            if not cpu_ext.q_act8_available():
                pytest.skip(f"the {build} build has no int8-activation path on this CPU (avx512 needs VNNI and VBMI)")
            got[build] = [cpu_ext.gemm_q(x, p, n, b) for x in xs for b in (None, bias)]
            exact = cpu_ext.gemm_q(xs[0], dataclasses.replace(p, act8=False), n, None)
            assert not torch.equal(exact, got[build][0]), build        # the pack's act8 took: not the exact path
    finally:
        cpu_ext.select(None)
    for i, (a, b) in enumerate(zip(got["avx512"], got["avx2"])):
        assert torch.equal(a, b), (kind, i, (a - b).abs().max())


@pytest.mark.parametrize("kind,packed,k", [("Q4_K", False, 512), ("Q6_K", True, 512), ("Q5_K", True, 512),
                                           ("Q4_K", False, 4096), ("Q6_K", True, 4096)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(act8, kind, packed, k):
    # K 4096 too: the quantized rows' codes 4 KiB apart (the int8 kernels' blocks of at most 6 rows fit the
    # 8 ways of an L1 set, so unlike the 14-row fp32 and W8A8 blocks they are read in place).
    w = _gguf(kind, 96, k)
    p = pack(w, packed=packed, act8=True)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    together = cpu_ext.gemm_q(x, p, 96, None)
    for r in range(9):
        assert torch.equal(cpu_ext.gemm_q(x[r:r + 1], p, 96, None)[0], together[r])


def test_what_it_does_not_serve_stays_exact(act8):
    # Groups that are not whole 4-input steps (6-bit codes in groups of 6, packed and as bytes) and groups over
    # 256 (W8A16's one group a row; 5-bit codes likewise): the exact path, bit for bit the dequantized GEMM.
    gen = torch.Generator().manual_seed(1)

    def weight(top, n, k, g, zero):
        s = torch.rand(n, k // g, generator=gen) * 0.01
        return Grouped(torch.randint(0, top, (n, k), dtype=torch.uint8, generator=gen), s, -zero * s, 8, g)

    w6, w8, w5 = weight(64, 40, 510, 6, 32), weight(256, 40, 512, 512, 128), weight(32, 33, 512, 512, 16)
    cases = [(w6, pack(w6, bits=6, act8=True)), (w6, pack(w6, act8=True)), (w8, pack(w8, act8=True)),
             (w5, pack(w5, bits=5, act8=True))]
    for w, p in cases:
        x = torch.randn(3, w.shape[1], generator=gen)
        want = cpu_ext.gemm(x, cpu_ext.pack_panels(w.dequantize()), w.shape[0], None)
        assert torch.equal(cpu_ext.gemm_q(x, p, w.shape[0], None), want), (p.bits, p.group)


def test_a_pack_without_act8_gives_the_exact_results_on_the_same_library(act8):
    w = _gguf("Q4_K", 64, 512)
    p = pack(w, act8=True)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    want = cpu_ext.gemm(x, cpu_ext.pack_panels(w.dequantize()), 64, None)
    assert not torch.equal(cpu_ext.gemm_q(x, p, 64, None), want)
    assert torch.equal(cpu_ext.gemm_q(x, pack(w), 64, None), want)
    assert not torch.equal(cpu_ext.gemm_q(x, p, 64, None), want)    # and back: nothing process-wide changed
