"""The compact layouts of grouped weights (handler/model/quant_int4.py pack, kernels/cpu_gemm_q4.c):
codes as nibbles, bytes or packed 5/6-bit planes; scales and mins fp32, fp16 or GGUF's two levels.
Each layout the packer picks gives back the weight exactly (unpack), the kernel on it is bit for bit
kernels/cpu_gemm.c's fp32 GEMM on the dequantized weight in every build this CPU runs (register
row blocks and dequantized panels), and the bytes streamed per weight are what the layout promises
(counted from the packed tensors, against GGUF's own block sizes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from handler.model import quant_formats as qf
from handler.model.quant_int4 import Grouped, Sub, code_bits, pack, unpack
from kernels import cpu as cpu_ext
from tests.support.kernels import each_build_fixture

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install -e '.[gguf]'")
from tests.model.test_gguf_blocks import _raw  # noqa: E402

each_build = each_build_fixture("gemm_q_available", "grouped-weight GEMM")
KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _gguf(kind: str, n: int, k: int, seed: int = 3) -> Grouped:
    rng = np.random.default_rng(seed)
    return qf.gguf_blocks(kind, _raw(kind, rng.standard_normal((n, k)).astype(np.float32), rng), n, k)


def _same(a: Grouped, b: Grouped) -> bool:
    return torch.equal(a.q, b.q) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)


def _bits_per_weight(p: cpu_ext.QPack, n: int, k: int) -> float:
    return sum(t.numel() * t.element_size() for t in p.tensors()) * 8 / (n * k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("packed", [False, True])
def test_each_gguf_kind_packs_compact_and_unpacks_exactly(kind, packed):
    n, k = 64, 512                        # whole panels and superblocks: no padding in the count
    w = _gguf(kind, n, k)
    p = pack(w, packed=packed)            # option.grouped_code_layout=packed / bytes
    assert _same(unpack(p, n, k), w)
    need = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}[kind]
    assert p.bits == (need if packed or need == 4 else 8)
    # scales: K-quants in two levels (an int8 sub-scale per group, fp32 d and e per 256 inputs;
    # Q6_K's min shares its scale's sub-scale), the 32-blocks fp16 (d and its min exact in fp16)
    if kind.endswith("_K"):
        assert p.smode == cpu_ext.QS_I8 and p.sg == 256 // w.group
        per_group = 8 if kind == "Q6_K" else 16
        scale_bits = per_group / w.group + 64 / 256
    else:
        assert p.smode == cpu_ext.QS_F16
        scale_bits = 32 / 32
    assert _bits_per_weight(p, n, k) == pytest.approx(p.bits + scale_bits)
    # never more than the flat fp32 layout, and the two-level K-quants within 0.25 bit of GGUF's own
    flat = pack(w, bits=8 if w.bits == 8 else 4, flat=True)
    assert _bits_per_weight(p, n, k) < _bits_per_weight(flat, n, k)
    if kind.endswith("_K") and (packed or kind == "Q4_K"):
        bs, ts = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)]
        assert _bits_per_weight(p, n, k) <= ts * 8 / bs + 0.25


@pytest.mark.parametrize("bits", [5, 6, 8])
@pytest.mark.parametrize("smode", ["flat", "fp16", "two-level"])
def test_kernel_on_every_layout_is_the_fp32_panel_gemm_bit_for_bit(each_build, bits, smode):
    if not cpu_ext.gemm_available():
        pytest.skip(f"the {each_build} build has no fp32 panel GEMM (kernels/cpu_gemm.c) to compare with")
    kind = {"two-level": "Q6_K" if bits == 6 else "Q5_K", "fp16": "Q5_0", "flat": "Q5_1"}[smode]
    n, k = 70, 512                        # a partial last panel
    w = _gguf(kind, n, k, seed=bits)
    if smode == "flat":                   # Q5_1's fp16 min d * m: an fp32 min fp16 cannot hold
        w = Grouped(w.q, w.scales, w.mins + w.scales * 2 ** -12, w.bits, w.group)
    p = pack(w, bits=bits if bits >= code_bits(w) else 8)
    assert p.smode == {"flat": cpu_ext.QS_F32, "fp16": cpu_ext.QS_F16, "two-level": cpu_ext.QS_I8}[smode]
    pw = cpu_ext.pack_panels(w.dequantize())
    b = torch.randn(n, generator=torch.Generator().manual_seed(4))
    for m in (1, 2, 3, 13, 40):           # register blocks (avx2: 2 rows, avx512: 12) and dequantized panels
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for bias in (None, b):
            assert torch.equal(cpu_ext.gemm_q(x, p, n, bias), cpu_ext.gemm(x, pw, n, bias)), (m, bias is None)


def test_two_level_scales_follow_row_selection_and_tensor_parallel_cuts():
    n, k = 64, 1024                       # 4 superblocks a row
    w = _gguf("Q4_K", n, k)
    assert w.sub is not None and w.sub.sg == 8
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for part in (w.rows(idx), w.cut("column", 1, 2), w.cut("row", 1, 2), Grouped.cat_rows([w, w.rows(idx)])):
        assert part.sub is not None
        s, m = part.sub.expand()
        assert torch.equal(s, part.scales) and torch.equal(m, part.mins)
        assert pack(part).smode == cpu_ext.QS_I8
    # a cut that splits superblocks drops the two levels (the flat scales stay exact)
    cut = w.cut("row", 1, 8)              # 4 groups a rank, 8 a superblock
    assert cut.sub is None and pack(cut).smode in (cpu_ext.QS_F16, cpu_ext.QS_F32)


def test_two_levels_that_do_not_give_back_the_scales_are_not_used():
    w = _gguf("Q4_K", 32, 256)
    bad = Grouped(w.q, w.scales, w.mins, w.bits, w.group,
                  Sub(w.sub.d * 2, w.sub.a, w.sub.e, w.sub.b, w.sub.sg))
    p = pack(bad)
    assert p.smode != cpu_ext.QS_I8 and _same(unpack(p, 32, 256), w)


def test_a_code_width_that_cannot_hold_the_codes_is_refused():
    w = _gguf("Q6_K", 32, 256)
    with pytest.raises(ValueError, match="need 6 bits"):
        pack(w, bits=5)
    with pytest.raises(ValueError, match="allowed"):
        pack(_gguf("Q4_K", 32, 256), bits=8)
